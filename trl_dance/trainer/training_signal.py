"""Rounds that train nothing: counted, warned about, and after a few in a row, stopped with their cause.

A round trains nothing when no training item can contribute a gradient (every advantage zero, every preference pair
masked, every hinge inactive) or when every optimizer update of the round saw an exactly zero gradient (a reward whose
gradient is zero). Weight decay would still move the weights, so without this check such a run looks alive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class TrainingSignal:
    """Per-round counters, read once per round (one host read, outside the micro-steps).

    Args:
        max_idle_rounds: rounds in a row that train nothing before :meth:`end_round` raises; 0 never raises.
    """

    def __init__(self, max_idle_rounds: int):
        self.max_idle_rounds = max_idle_rounds
        self.idle_rounds = 0
        self._items: list[torch.Tensor] = []
        self._grad_norms: list[torch.Tensor | float] = []

    def add_items(self, count: torch.Tensor | int) -> None:
        """This process's training items of the round that can contribute a gradient (a device scalar, never read
        here; :meth:`end_round` sums them over processes once)."""
        self._items.append(torch.as_tensor(count).detach().float().reshape(()))

    def add_grad_norm(self, norm: torch.Tensor | float | None) -> None:
        """The gradient norm of one optimizer update (before clipping)."""
        if norm is not None:
            self._grad_norms.append(norm.detach().float().reshape(()) if torch.is_tensor(norm) else float(norm))

    def end_round(
        self, round_index: int, no_items: str, zero_gradient: str, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> str | None:
        """Close a round: the cause if it trained nothing (``no_items`` when no item of any process could contribute,
        else ``zero_gradient`` when every update's gradient was exactly zero), logged as a warning; ``None`` otherwise.
        ``reduce`` sums a (1,) tensor over the processes (every process calls it when the method counts items).

        Raises:
            RuntimeError with the cause after ``max_idle_rounds`` such rounds in a row.
        """
        items = reduce(torch.stack(self._items).sum().reshape(1)).item() if self._items else None
        norms = [float(n) for n in self._grad_norms]
        self._items, self._grad_norms = [], []
        cause = None
        if items == 0:
            cause = no_items
        elif norms and all(n == 0 for n in norms):
            cause = zero_gradient
        if cause is None:
            self.idle_rounds = 0
            return None
        self.idle_rounds += 1
        message = f"round {round_index} trained nothing: {cause}"
        if self.max_idle_rounds and self.idle_rounds >= self.max_idle_rounds:
            raise RuntimeError(
                f"{self.idle_rounds} rounds in a row trained nothing (max_idle_rounds={self.max_idle_rounds}); last: "
                f"{message}"
            )
        logger.warning(message)
        return cause
