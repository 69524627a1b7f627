"""The ``log_metric`` callback TRL passes to reward functions: scalars a reward logs, averaged at each flush."""

from __future__ import annotations

from collections import defaultdict

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object


class RewardMetricLog:
    """``log_metric(name, value)`` for the rewards (callable from the scoring thread); :meth:`flush` averages the
    values logged since the last flush over calls and processes."""

    def __init__(self):
        self.pending: defaultdict[str, list[float]] = defaultdict(list)

    def __call__(self, name: str, value: float) -> None:
        self.pending[name].append(float(value))

    def flush(self, accelerator: Accelerator) -> dict[str, float]:
        """``{name: mean}`` over every process's values. Collective: call on every process."""
        pending, self.pending = self.pending, defaultdict(list)
        means = {}
        for name in sorted(set(sum(gather_object([list(pending)]), []))):  # the same order on every process
            values = pending.get(name, [])
            local = torch.tensor([[sum(values), len(values)]], device=accelerator.device)
            total, count = accelerator.gather(local).sum(dim=0).tolist()
            means[name] = total / max(count, 1)
        return means
