"""Shared schedule and SDE step of rectified-flow (velocity-prediction) policies such as FLUX and SD3."""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline

from ..schedulers import flow_match_sigmas
from ..sde import SDEStepOutput, dance_sigmas, flow_sde_step
from .base import DiffusionPolicy, SamplerSettings


class FlowMatchingPolicy(DiffusionPolicy):
    """A velocity-prediction policy stepping with :func:`trl_dance.sde.flow_sde_step` on an explicit σ table."""

    def __init__(self, pipeline: DiffusionPipeline, settings: SamplerSettings):
        super().__init__(pipeline, settings)
        if settings.sigma_schedule == "dance":
            self.sigmas = dance_sigmas(settings.num_inference_steps, settings.shift)
        elif settings.sigma_schedule == "pipeline":
            # A copy, so the pipeline's own scheduler state is left as the user had it.
            scheduler = type(pipeline.scheduler).from_config(pipeline.scheduler.config)
            scheduler.set_timesteps(settings.num_inference_steps, **self._scheduler_kwargs())
            self.sigmas = flow_match_sigmas(scheduler)
        else:
            raise ValueError(f"sigma_schedule must be 'dance' or 'pipeline', got {settings.sigma_schedule!r}")

    def _scheduler_kwargs(self) -> dict:
        """Extra ``set_timesteps`` arguments of the family (FLUX's resolution-dependent shift ``mu``)."""
        return {}

    def model_timestep(self, step_index: torch.Tensor) -> torch.Tensor:
        return self.timestep_from_sigma(self.sigma(step_index))

    def timestep_from_sigma(self, sigma: torch.Tensor) -> torch.Tensor:
        """The denoiser's timestep input for noise level σ: ``σ · T_train`` (diffusers' flow-matching convention)."""
        return sigma * self.pipeline.scheduler.config.num_train_timesteps

    def sigma(self, step_index: torch.Tensor) -> torch.Tensor:
        """σ at each step index: (B,) float32 on the index's device."""
        return self.sigmas.to(step_index.device)[step_index]

    def step(
        self,
        model_output: torch.Tensor,
        latents: torch.Tensor,
        step_index: torch.Tensor,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        compute_log_prob: bool = True,
        noise: torch.Tensor | None = None,
        noise_level: float | None = None,
    ) -> SDEStepOutput:
        sigmas = self.sigmas.to(latents.device)
        return flow_sde_step(
            model_output,
            latents,
            sigmas[step_index],
            sigmas[step_index + 1],
            sde_type=self.settings.sde_type,
            noise_level=self.settings.noise_level if noise_level is None else noise_level,
            prev_sample=prev_sample,
            generator=generator,
            sigma_max=sigmas[1],
            reduction=self.settings.log_prob_reduction,
            compute_log_prob=compute_log_prob,
            noise=noise,
        )
