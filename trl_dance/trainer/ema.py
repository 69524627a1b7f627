"""An exponential moving average of the trained parameters (diffusers' ``EMAModel``), for evaluation and export."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from diffusers.training_utils import EMAModel
from transformers import TrainerCallback


@dataclass
class EMAArguments:
    r"""
    Parameters:
        use_ema (`bool`, defaults to `False`): Keep an exponential moving average of the trained parameters (the LoRA,
            or the denoiser), updated after every optimizer step with diffusers' `EMAModel` (its decay warm-up
            min(ema_decay, (1 + n)/(10 + n)) at step n). Evaluations sample with it, and every save writes it beside
            the trained weights, in `ema/` (same format); checkpoints carry it for exact resume.
        ema_decay (`float`, defaults to `0.999`): The EMA's decay in (0, 1).
    """

    use_ema: bool = field(default=False, metadata={"help": "Keep an EMA of the trained parameters (saved in ema/)."})
    ema_decay: float = field(default=0.999, metadata={"help": "EMA decay in (0, 1)."})

    def _check_ema(self) -> None:
        if not 0 < self.ema_decay < 1 or not math.isfinite(self.ema_decay):
            raise ValueError(f"ema_decay must be in (0, 1), got {self.ema_decay}")


class EMAWeights:
    """The EMA of ``module``'s trainable parameters."""

    def __init__(self, module: torch.nn.Module, decay: float):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.ema = EMAModel(self.params, decay=decay)

    def step(self) -> None:
        self.ema.step(self.params)

    @contextlib.contextmanager
    def applied(self):
        """Inside, the module's trainable parameters hold the EMA; the trained values are back on exit."""
        self.ema.store(self.params)
        self.ema.copy_to(self.params)
        try:
            yield
        finally:
            self.ema.restore(self.params)

    def state_dict(self) -> dict:
        return self.ema.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state)


class EMAUpdate(TrainerCallback):
    """Steps the EMA after every optimizer update."""

    def __init__(self, weights: EMAWeights):
        self.weights = weights

    def on_step_end(self, args, state, control, **kwargs):
        self.weights.step()
