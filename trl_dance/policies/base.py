"""The interface between RL trainers and a diffusers pipeline.

A policy owns the pipeline's frozen parts (text encoders, VAE) and knows the model family's conventions (latent
layout, timestep scaling, conditioning, CFG). It knows nothing about rewards or losses. The trainable denoiser is
passed in to :meth:`DiffusionPolicy.predict` so the trainer can call it through its DDP/DeepSpeed wrapper.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from diffusers import DiffusionPipeline

from ..sde import Reduction, SDEStepOutput

Conditioning = dict[str, torch.Tensor]
"""Prompt conditioning: tensors with the prompt (or sample) as first dimension, indexable per sample."""


@dataclass
class SamplerSettings:
    """How a policy samples. See :class:`~trl_dance.DanceGRPOConfig` for the meaning of each field."""

    num_inference_steps: int = 16
    height: int = 720
    width: int = 720
    guidance_scale: float = 3.5
    noise_level: float = 0.3
    sde_type: Literal["dance", "flow_grpo", "cps"] = "dance"
    sigma_schedule: Literal["dance", "pipeline"] = "dance"
    shift: float = 3.0
    max_sequence_length: int = 512
    log_prob_reduction: Reduction = "mean"


class DiffusionPolicy(ABC):
    """A diffusers pipeline seen as a stochastic policy over denoising steps.

    Steps are addressed by integer index ``i ∈ [0, N)``; step ``i`` maps the latent at index ``i`` of the
    trajectory to the one at ``i + 1``.
    """

    denoiser_name: str = "transformer"
    """Attribute of the pipeline holding the trainable denoiser (also the LoRA prefix in ``save_lora_weights``)."""

    def __init__(self, pipeline: DiffusionPipeline, settings: SamplerSettings):
        self.pipeline = pipeline
        self.settings = settings
        vae_scale = getattr(pipeline, "vae_scale_factor", 8)
        for name, size in (("height", settings.height), ("width", settings.width)):
            if size % (2 * vae_scale):
                raise ValueError(f"{name}={size} must be a multiple of {2 * vae_scale} for {type(pipeline).__name__}")

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, self.denoiser_name)

    @property
    def num_steps(self) -> int:
        return self.settings.num_inference_steps

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Pipeline modules other than the denoiser: text encoders and VAE, never trained."""
        return [
            module
            for name, module in self.pipeline.components.items()
            if isinstance(module, torch.nn.Module) and name != self.denoiser_name
        ]

    def to(self, device: torch.device | str) -> DiffusionPolicy:
        """Move the frozen modules to ``device`` (the trainer places the denoiser)."""
        for module in self.frozen_modules():
            module.requires_grad_(False).to(device)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device

    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Text conditioning of each prompt (computed without gradients), first dimension ``len(prompts)``."""

    @abstractmethod
    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, ...) float32 starting latents, sample ``b`` drawn from ``generators[b]``."""

    @abstractmethod
    def predict(
        self, model: torch.nn.Module, latents: torch.Tensor, step_index: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """The network output the step uses (velocity or ε; CFG-combined where the policy uses CFG).

        Args:
            model: the denoiser, possibly wrapped (DDP, DeepSpeed); called once (CFG branches batched).
            latents: (B, ...) float32 latents at ``step_index``.
            step_index: (B,) long, the step of each sample (samples may be at different steps).
            cond: conditioning of each of the B samples.

        Returns:
            (B, ...) float32.
        """

    @abstractmethod
    def step(
        self,
        model_output: torch.Tensor,
        latents: torch.Tensor,
        step_index: torch.Tensor,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        compute_log_prob: bool = True,
    ) -> SDEStepOutput:
        """The stochastic transition from ``step_index`` to ``step_index + 1`` (see :mod:`trl_dance.sde`)."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents to images: (B, 3, H, W) float32 in [0, 1]."""
