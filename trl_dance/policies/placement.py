"""Where a policy's frozen modules live: on the accelerator, or offloaded to the CPU as its runtime says."""

from __future__ import annotations

import contextlib
from typing import Self

import torch
from diffusers import DiffusionPipeline

from .runtime import PolicyRuntime


class FrozenModules:
    """The pipeline modules a policy never trains (text encoders, VAE, a frozen expert) and their placement under
    ``runtime``'s offload flags. A base of :class:`~trl_dance.policies.DiffusionPolicy`."""

    pipeline: DiffusionPipeline
    runtime: PolicyRuntime
    denoiser_name: str

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, self.denoiser_name)

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Pipeline modules other than the denoiser: text encoders and VAE, never trained."""
        return [
            module
            for name, module in self.pipeline.components.items()
            if isinstance(module, torch.nn.Module) and name != self.denoiser_name
        ]

    def text_encoders(self) -> list[torch.nn.Module]:
        return [
            module
            for name, module in self.pipeline.components.items()
            if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)
        ]

    @property
    def frozen_expert(self) -> torch.nn.Module | None:
        """The denoiser that serves the steps of the trained one's frozen partner (two-expert Wan 2.2), else None."""
        return None

    def offloaded_modules(self) -> list[torch.nn.Module]:
        """Frozen modules kept on the CPU and moved to the accelerator only while used: the text encoders with
        ``runtime.offload_text_encoders``, the frozen expert with ``runtime.offload_frozen_expert``."""
        offloaded = self.text_encoders() if self.runtime.offload_text_encoders else []
        if self.runtime.offload_frozen_expert and self.frozen_expert is not None:
            offloaded.append(self.frozen_expert)
        return offloaded

    @contextlib.contextmanager
    def sampling(self):
        """Hold around rollouts: with ``runtime.offload_frozen_expert`` the frozen expert is on the accelerator only
        inside. Re-entrant (also across copies of the policy), so a round of several rollout chunks moves it once each
        way."""
        runtime = self.runtime
        module = self.frozen_expert if runtime.offload_frozen_expert else None
        outermost = module is not None and runtime.sampling_depth == 0
        if outermost:
            module.to(self.device)
        runtime.sampling_depth += 1
        try:
            yield
        finally:
            runtime.sampling_depth -= 1
            if outermost:
                module.to("cpu")

    def to(self, device: torch.device | str) -> Self:
        """Move the frozen modules to ``device`` (the trainer places the denoiser), except
        :meth:`offloaded_modules`, which stay on the CPU."""
        offloaded = self.offloaded_modules()
        for module in self.frozen_modules():
            module.requires_grad_(False).to("cpu" if any(module is m for m in offloaded) else device)
        return self

    @contextlib.contextmanager
    def _text_encoders_on_device(self):
        encoders = self.text_encoders() if self.runtime.offload_text_encoders else []
        for module in encoders:
            module.to(self.device)
        try:
            yield
        finally:
            for module in encoders:
                module.to("cpu")

    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device


__all__ = ["FrozenModules"]
