"""Shared schedule and SDE step of rectified-flow (velocity-prediction) policies such as FLUX and SD3."""

from __future__ import annotations

import functools

import torch
from diffusers import DiffusionPipeline
from diffusers.training_utils import compute_density_for_timestep_sampling

from ..forward_process import UNIFORM, TimeDensity, euler_step, flow_coefficients
from ..schedulers import flow_match_sigmas
from ..sde import SDEStepOutput, dance_sigmas, flow_dpm_solver_step, flow_sde_step
from .base import Conditioning, DiffusionPolicy, SamplerSettings


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
        self.sigma_values = tuple(self.sigmas.tolist())  # host copy: samplers read σ_i without a device read

    def _scheduler_kwargs(self) -> dict:
        """Extra ``set_timesteps`` arguments of the family (FLUX's resolution-dependent shift ``mu``)."""
        return {}

    def model_timestep(self, step_index: torch.Tensor) -> torch.Tensor:
        return self.timestep_at(self.sigma(step_index))

    def timestep_at(self, t: torch.Tensor) -> torch.Tensor:
        """The denoiser's timestep input at noise level σ = ``t``: ``σ · T_train`` (diffusers' flow-matching
        convention)."""
        return t * self.pipeline.scheduler.config.num_train_timesteps

    # The forward process (σ = t): x_σ = (1 − σ)·x0 + σ·ε, target ε − x0.

    def noise_coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flow_coefficients(t)

    def training_target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return noise - x0

    def sample_training_times(
        self,
        count: int,
        generator: torch.Generator | None,
        device: torch.device | str,
        density: TimeDensity = UNIFORM,
    ) -> torch.Tensor:
        """σ = :meth:`training_sigmas` at ⌊u·T_train⌋, u from diffusers' density (so the pipeline's shift applies)."""
        d = density
        u = compute_density_for_timestep_sampling(
            d.scheme, count, d.logit_mean, d.logit_std, d.mode_scale, device, generator
        )
        grid = self._training_grid.to(u.device)
        return grid[(u * len(grid)).long().clamp_max(len(grid) - 1)]

    def deterministic_step(
        self, model_output: torch.Tensor, latents: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor
    ) -> torch.Tensor:
        return euler_step(latents, model_output.to(latents.dtype), t, t_next)

    @functools.cached_property
    def _training_grid(self) -> torch.Tensor:
        return self.training_sigmas()

    def training_sigmas(self) -> torch.Tensor:
        """(T_train,) float32 CPU: the noise levels the model was trained on, from 1 down to 1/T_train, shifted as
        the pipeline's scheduler shifts them at rest (FlowMatchEuler's static ``shift``, e.g. SD3's 3; UniPC's
        ``flow_shift`` for Wan; none for dynamically shifted families such as FLUX). Forward-process losses (Diffusion-
        DPO) draw their σ from this grid."""
        config = self.pipeline.scheduler.config
        steps = config.num_train_timesteps
        u = torch.arange(steps, 0, -1, dtype=torch.float64) / steps
        if config.get("use_flow_sigmas"):
            shift = config.get("flow_shift") or 1.0
        elif config.get("use_dynamic_shifting"):
            shift = 1.0
        else:
            shift = config.get("shift", 1.0)
        return (shift * u / (1 + (shift - 1) * u)).to(torch.float32)

    def sigma(self, step_index: torch.Tensor) -> torch.Tensor:
        """σ at each step index: (B,) float32 on the index's device."""
        return self.sigmas.to(step_index.device)[step_index]

    def sigma_at(self, positions: torch.Tensor) -> torch.Tensor:
        """σ at fractional step positions in [0, N] (float32, CPU): the ``"dance"`` schedule evaluated in between (a
        shifted linspace, as MixGRPO-Flash builds its grid), the ``"pipeline"`` table interpolated linearly."""
        positions = positions.to(torch.float64)
        if self.settings.sigma_schedule == "dance":
            shift, u = self.settings.shift, 1 - positions / self.num_steps
            return (shift * u / (1 + (shift - 1) * u)).to(torch.float32)
        table = self.sigmas.to(torch.float64)
        low = positions.floor().long().clamp(max=self.num_steps - 1)
        weight = positions - low
        return (table[low] * (1 - weight) + table[low + 1] * weight).to(torch.float32)

    def predict_at_sigma(
        self, model: torch.nn.Module, latents: torch.Tensor, sigma: float, cond: Conditioning
    ) -> torch.Tensor:
        """The velocity at noise level ``sigma`` (a float, any value, not only the grid's), CFG-combined like
        :meth:`predict`."""
        timestep = self.timestep_at(torch.full((latents.shape[0],), sigma, device=latents.device))
        return self.predict_at(model, latents, timestep, cond)

    def solve(
        self,
        model: torch.nn.Module,
        latents: torch.Tensor,
        cond: Conditioning,
        sigmas: tuple[float, ...],
        solver: str = "ode",
        previous: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Deterministic steps along ``sigmas`` (from the current σ down to 0): ``"ode"`` the Euler step,
        ``"dpm_solver++"`` DPM-Solver++(2M) (:func:`~trl_dance.sde.flow_dpm_solver_step`), whose first step is second
        order when ``previous`` = (x̂0, σ) of the step that reached ``latents`` is given (MixGRPO-Flash continues from
        the last SDE step's x̂0). Returns float32 latents."""
        if solver not in ("ode", "dpm_solver++"):
            raise ValueError(f"solver must be 'ode' or 'dpm_solver++', got {solver!r}")
        latents = latents.float()
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            velocity = self.predict_at_sigma(model, latents, sigma, cond)
            if solver == "ode":
                latents = latents + (sigma_next - sigma) * velocity
                continue
            x0_hat = latents - sigma * velocity
            latents, previous = flow_dpm_solver_step(x0_hat, latents, sigma, sigma_next, previous), (x0_hat, sigma)
        return latents

    def predicted_clean(
        self, model_output: torch.Tensor, latents: torch.Tensor, step_index: torch.Tensor
    ) -> torch.Tensor:
        """x̂0 = x_σ − σ·v, (B, ...) float32."""
        sigma = self.sigma(step_index).view(-1, *[1] * (latents.ndim - 1))
        return latents.float() - sigma * model_output.float()

    def step(
        self,
        model_output: torch.Tensor,
        latents: torch.Tensor,
        step_index: torch.Tensor,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        compute_log_prob: bool = True,
        noise: torch.Tensor | None = None,
        eta: float | None = None,
    ) -> SDEStepOutput:
        sigmas = self.sigmas.to(latents.device)
        return flow_sde_step(
            model_output,
            latents,
            sigmas[step_index],
            sigmas[step_index + 1],
            sde_type=self.settings.sde_type,
            eta=self.settings.eta if eta is None else eta,
            prev_sample=prev_sample,
            generator=generator,
            sigma_max=sigmas[1],
            sigma_min=sigmas[-1],
            reduction=self.settings.log_prob_reduction,
            compute_log_prob=compute_log_prob,
            noise=noise,
        )
