"""The "old" policy of forward-process methods (DiffusionNFT, AWM): a soft-updated copy of the trained parameters."""

from __future__ import annotations

import torch
from torch.func import functional_call


class OldPolicy:
    """A frozen float32 copy of a module's trainable parameters (the LoRA, or the whole denoiser in a full
    fine-tune), soft-updated ``old ← λ·old + (1 − λ)·θ``, and a forward pass of the module with it in their place.

    One copy for LoRA and full fine-tuning alike: the forward substitutes the copy for the trained tensors through
    ``torch.func.functional_call``, so no second adapter is registered with peft (whose ``set_adapter`` would also
    flip ``requires_grad`` on every switch), and the optimizer, DDP and DeepSpeed never see it.
    """

    def __init__(self, module: torch.nn.Module, initial: dict[str, torch.Tensor] | None = None):
        self.module = module
        if initial is None:  # the module's trainable tensors
            initial = {name: p for name, p in module.named_parameters() if p.requires_grad}
        self.params = {name: p.detach().float().clone() for name, p in initial.items()}
        if not self.params:
            raise ValueError("the module has no trainable parameters to keep an old copy of")

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """``old ← decay·old + (1 − decay)·θ``; ``decay = 0`` makes the old policy the current one."""
        if not 0 <= decay <= 1:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        for name, p in self.module.named_parameters():
            if name in self.params:
                self.params[name].lerp_(p.detach().float(), 1 - decay)

    @property
    def model(self) -> torch.nn.Module:
        """A module that calls the trained one with the old parameters in place (without gradients)."""
        return _Proxy(self.module, self.params)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value.cpu() for name, value in self.params.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.params):
            raise ValueError("the saved old policy does not match the trained parameters")
        for name, value in state.items():
            self.params[name].copy_(value)


class _Proxy(torch.nn.Module):
    """Calls ``module`` with ``params`` substituted, and reports its ``dtype`` (the policies read it); without
    gradients unless ``grad`` (then the call is differentiable in ``params``)."""

    def __init__(self, module: torch.nn.Module, params: dict[str, torch.Tensor], grad: bool = False):
        super().__init__()
        object.__setattr__(self, "_target", module)
        object.__setattr__(self, "_params", params)
        object.__setattr__(self, "_grad", grad)

    @property
    def dtype(self) -> torch.dtype:
        return self._target.dtype

    def forward(self, *args, **kwargs):
        with torch.set_grad_enabled(self._grad and torch.is_grad_enabled()):
            return functional_call(self._target, self._params, args, kwargs, strict=False)


def nft_decay(step: int, schedule: str) -> float:
    """DiffusionNFT's old-policy decay λ at optimizer step ``step``: ``"linear"`` min(0.001·step, 0.5) (its default),
    ``"delayed"`` 0 for 75 steps then min(0.0075·(step − 75), 0.999) (its OCR setting), ``"none"`` 0 (on-policy)."""
    if schedule == "linear":
        return min(0.001 * step, 0.5)
    if schedule == "delayed":
        return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)
    if schedule == "none":
        return 0.0
    raise ValueError(f"old_policy_decay must be 'linear', 'delayed' or 'none', got {schedule!r}")
