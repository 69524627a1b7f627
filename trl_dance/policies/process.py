"""The diffusion process a policy samples and trains on: its step grid, the SDE/ODE transition with its Gaussian
log-probability, and the forward process x_t = α_t·x0 + σ_t·ε at a time t ∈ [0, 1] (1: pure noise).

A policy holds one (``policy.process``), built from its pipeline's scheduler config; the math itself lives in
:mod:`trl_dance.sde` and :mod:`trl_dance.forward_process`. A trainer that needs one parametrisation checks the type
once (:func:`require_flow`) and then uses the typed members (a flow process's σ grid).

- :class:`FlowProcess` (FLUX, SD3, Wan, ...): σ = t, ``(α, σ) = (1 − t, t)``, the model predicts the velocity ε − x0,
  steps with :func:`~trl_dance.sde.flow_sde_step` on an explicit σ table.
- :class:`VPProcess` (SD1.x/2.x, SDXL): DDIM-η steps on DDIM's timesteps, the training timestep ``round(t·(T − 1))``,
  ``(α, σ) = (√ᾱ, √(1 − ᾱ))``, the model predicts ε, v or x0.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Literal

import torch
from diffusers import DDIMScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling

from ..forward_process import (
    UNIFORM,
    TimeDensity,
    add_noise,
    euler_step,
    flow_coefficients,
    per_sample,
    recover_clean,
    vp_coefficients,
)
from ..schedulers import ddim_alpha_pairs, flow_match_sigmas
from ..sde import (
    PREDICTION_TYPES,
    SDEStepOutput,
    Segments,
    dance_sigmas,
    ddim_sde_step,
    diffusion_target,
    epsilon_and_x0,
    flow_sde_step,
)
from .settings import SamplerSettings


class DiffusionProcess(ABC):
    """A sampler's ``num_steps``-step grid (step ``i`` maps the latents at index ``i`` to ``i + 1``) and the forward
    process of the model, addressed by a time t ∈ [0, 1]."""

    prediction_type: str
    """What the denoiser predicts, in diffusers' names: ``"flow_prediction"``, ``"epsilon"``, ``"v_prediction"`` or
    ``"sample"``."""

    def __init__(self, settings: SamplerSettings):
        self.settings = settings
        self.num_steps = settings.num_inference_steps

    @abstractmethod
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
        segments: Segments = None,
    ) -> SDEStepOutput:
        """The stochastic transition from ``step_index`` (B,) to ``step_index + 1`` (see :mod:`trl_dance.sde`), at
        ``eta`` (default ``settings.eta``; 0 is the deterministic ODE / DDIM step, without log-prob); ``segments``:
        per-stream log-probabilities (B, S)."""

    @abstractmethod
    def model_timestep(self, step_index: torch.Tensor) -> torch.Tensor:
        """(B,) the timestep each sample's step feeds the denoiser, in the model's own units."""

    @abstractmethod
    def timestep_at(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) the denoiser's timestep input at times ``t`` (B,), in the model's own units."""

    @abstractmethod
    def predicted_clean(
        self, model_output: torch.Tensor, latents: torch.Tensor, step_index: torch.Tensor
    ) -> torch.Tensor:
        """The clean latents x̂0 (B, ...) float32 the network output at ``latents`` of step ``step_index`` predicts."""

    @abstractmethod
    def noise_coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(α_t, σ_t)``, each (B,) float32 on ``t``'s device, at times ``t`` (B,)."""

    @abstractmethod
    def training_target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(B, ...) what the denoiser is trained to output at :meth:`add_noise`'s ``x_t`` (flow: ε − x0; ε, v or x0 as
        the model's ``prediction_type``)."""

    @abstractmethod
    def sample_training_times(
        self,
        count: int,
        generator: torch.Generator | None,
        device: torch.device | str,
        density: TimeDensity = UNIFORM,
    ) -> torch.Tensor:
        """(count,) float32 times at which the model was trained, as its training script draws them: flow models
        u from ``density`` read on the model's own training grid; ε/v models a uniform training timestep (they ignore
        ``density``)."""

    @abstractmethod
    def deterministic_step(
        self, model_output: torch.Tensor, latents: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor
    ) -> torch.Tensor:
        """One step of the deterministic sampler from times ``t`` to ``t_next`` (B,), either direction (flow: Euler;
        ε/v: DDIM with η = 0), differentiable in ``model_output`` and ``latents``."""

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``x_t = α_t·x0 + σ_t·ε``: clean latents ``x0`` (B, ...) noised with ``noise`` (B, ...) to times ``t`` (B,)."""
        return add_noise(x0, noise, *self.noise_coefficients(t))

    def recover_clean(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``(x_t − σ_t·ε)/α_t``: the clean latents of ``latents`` (B, ...) at times ``t`` (B,) < 1 given their known
        noise, the inverse of :meth:`add_noise`."""
        return recover_clean(latents, noise, *self.noise_coefficients(t))

    def check_schedule(self, steps: list[int]) -> None:
        """Raise ``ValueError`` if one of ``steps`` (the trainable ones) has zero noise, hence no log-probability.

        Checked once, on the CPU, through the same :meth:`step` the sampler uses; the step itself does not check
        its per-sample std, which would cost a host-device sync every step.
        """
        trainable = torch.tensor(steps, dtype=torch.long)
        if len(trainable) > 0:
            zeros = torch.zeros(len(trainable), 1)
            std = self.step(zeros, zeros, trainable, prev_sample=zeros, compute_log_prob=False).std
            if (std <= 0).any():
                raise ValueError(
                    f"steps {trainable[std <= 0].tolist()} of the {self.num_steps}-step schedule have zero standard "
                    f"deviation (noise level {self.settings.eta}, sde_type {self.settings.sde_type!r}): their "
                    "log-probability is undefined. Use a positive noise level or a schedule without repeated sigmas."
                )

    def log_prob_gradient_scale(self, steps: list[int]) -> torch.Tensor:
        """(len(steps),) float32: how strongly each step's log-probability responds to the network output,
        |∂μ/∂output| / std for the step's Gaussian mean μ and std (flow: Δσ·(1 + s²(1−σ)/(2σ)) / (s·√Δσ)). On-policy,
        the gradient of a transition's log-prob with respect to the output is this times the step's standard noise,
        so it is the time-dependent scale Flash-GRPO's temporal gradient rectification divides out. Every step is
        affine in the output, so one finite difference on (len(steps), 1) probes is exact."""
        index = torch.tensor(steps, dtype=torch.long)
        zeros, ones = torch.zeros(len(steps), 1), torch.ones(len(steps), 1)
        at_zero = self.step(zeros, zeros, index, prev_sample=zeros, compute_log_prob=False)
        at_one = self.step(ones, zeros, index, prev_sample=zeros, compute_log_prob=False)
        return (at_one.mean - at_zero.mean).abs().flatten() / at_zero.std


TimestepUnits = Literal["train_steps", "sigma", "one_minus_sigma"]


class FlowProcess(DiffusionProcess):
    """Rectified flow on an explicit σ table: ``settings.sigma_schedule`` ``"dance"`` (a shifted linspace) or
    ``"pipeline"`` (the scheduler's own grid, set with the family's ``scheduler_kwargs``, e.g. FLUX's ``mu``).

    ``timestep_units``: what the denoiser's timestep input is at noise level σ: ``"train_steps"`` σ·T_train (diffusers'
    flow-matching convention), ``"sigma"`` σ itself (FLUX, Qwen-Image 2.1), ``"one_minus_sigma"`` (T − σ·T)/T (Z-Image).
    """

    prediction_type = "flow_prediction"

    def __init__(
        self,
        scheduler,
        settings: SamplerSettings,
        scheduler_kwargs: dict | None = None,
        timestep_units: TimestepUnits = "train_steps",
    ):
        super().__init__(settings)
        self.scheduler_config = scheduler.config
        self.timestep_units = timestep_units
        if settings.sigma_schedule == "dance":
            self.sigmas = dance_sigmas(settings.num_inference_steps, settings.shift)
        elif settings.sigma_schedule == "pipeline":
            # A copy, so the pipeline's own scheduler state is left as the user had it.
            copy = type(scheduler).from_config(scheduler.config)
            copy.set_timesteps(settings.num_inference_steps, **(scheduler_kwargs or {}))
            self.sigmas = flow_match_sigmas(copy)
        else:
            raise ValueError(f"sigma_schedule must be 'dance' or 'pipeline', got {settings.sigma_schedule!r}")
        self.sigma_values = tuple(self.sigmas.tolist())  # host copy: samplers read σ_i without a device read

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

    def model_timestep(self, step_index: torch.Tensor) -> torch.Tensor:
        return self.timestep_at(self.sigma(step_index))

    def timestep_at(self, t: torch.Tensor) -> torch.Tensor:
        if self.timestep_units == "sigma":
            return t
        train_steps = self.scheduler_config.num_train_timesteps
        if self.timestep_units == "one_minus_sigma":  # (the pipeline's float32 operations)
            return (train_steps - t * train_steps) / train_steps
        return t * train_steps

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
        config = self.scheduler_config
        steps = config.num_train_timesteps
        u = torch.arange(steps, 0, -1, dtype=torch.float64) / steps
        if config.get("use_flow_sigmas"):
            shift = config.get("flow_shift") or 1.0
        elif config.get("use_dynamic_shifting"):
            shift = 1.0
        else:
            shift = config.get("shift", 1.0)
        return (shift * u / (1 + (shift - 1) * u)).to(torch.float32)

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
        segments: Segments = None,
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
            segments=segments,
        )


class StreamFlowProcess(FlowProcess):
    """Rectified flow whose streams step down their own σ grids in one transition (MiniMax-H3: a sample's video rows on
    the shift-12 grid, its audio rows on the shift-3 one, both N steps long): σ is per element, the stream's, so the
    step's mean, std and log-density are per element too (the log-probability is still one Gaussian over the sample;
    ``segments`` reduce it per stream as for any family). The denoiser's timestep is per stream: (B, S) of ``1 − σ``
    (:meth:`model_timestep`; the H3 convention, t = 1 clean).

    What needs one σ per sample — the forward process (NFT, Diffusion-DPO, SFT, distillation), Δσ-based options
    (GRPO-Guard's ratio normalisation, Flash-GRPO's gradient rectification), fractional steps (MixGRPO-Flash) — raises.
    """

    def __init__(self, grids: dict[str, torch.Tensor], streams: dict[str, int], settings: SamplerSettings):
        DiffusionProcess.__init__(self, settings)
        if list(grids) != list(streams):
            raise ValueError(f"one σ grid per stream, in the streams' order: got {list(grids)} for {list(streams)}")
        lengths = {name: len(grid) for name, grid in grids.items()}
        if set(lengths.values()) != {settings.num_inference_steps + 1}:
            raise ValueError(
                f"each stream's σ grid must have num_inference_steps + 1 = {settings.num_inference_steps + 1} values "
                f"(its terminal one included), got {lengths}"
            )
        self.stream_sigmas = torch.stack([grid.to("cpu", torch.float32) for grid in grids.values()])  # (S, N + 1)
        self.segments = tuple(streams.values())

    def _one_sigma(self, what: str):
        raise NotImplementedError(
            f"{what} needs one noise level per sample, but this process steps its streams "
            f"({len(self.segments)}) on their own σ grids (MiniMax-H3's video and audio); use a GRPO-family method "
            "without Δσ options"
        )

    @property
    def sigmas(self) -> torch.Tensor:
        self._one_sigma("the σ table")

    @property
    def sigma_values(self) -> tuple[float, ...]:
        self._one_sigma("the σ table")

    def sigma(self, step_index: torch.Tensor) -> torch.Tensor:
        self._one_sigma("σ at a step")

    def sigma_at(self, positions: torch.Tensor) -> torch.Tensor:
        self._one_sigma("σ between steps")

    def stream_sigma(self, step_index: torch.Tensor) -> torch.Tensor:
        """(B, S) float32: each stream's σ at each step index, on the index's device."""
        return self.stream_sigmas.to(step_index.device)[:, step_index].T

    def element_sigma(self, step_index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """σ per element of latents ``like`` (B, ...) at ``step_index`` (B,): each stream's over its elements."""
        repeats = torch.tensor(self.segments, device=like.device)
        per_stream = self.stream_sigma(step_index.to(like.device))
        return per_stream.repeat_interleave(repeats, dim=1, output_size=sum(self.segments)).view(like.shape)

    def model_timestep(self, step_index: torch.Tensor) -> torch.Tensor:
        """(B, S): each stream's ``1 − σ`` (float32, as MiniMax-H3's scheduler computes its timesteps)."""
        return 1.0 - self.stream_sigma(step_index)

    def timestep_at(self, t: torch.Tensor) -> torch.Tensor:
        self._one_sigma("a forward-process time")

    def noise_coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._one_sigma("the forward process")

    def sample_training_times(self, count, generator, device, density: TimeDensity = UNIFORM) -> torch.Tensor:
        self._one_sigma("the forward process")

    def training_sigmas(self) -> torch.Tensor:
        self._one_sigma("the forward process")

    def deterministic_step(self, model_output, latents, t, t_next) -> torch.Tensor:
        self._one_sigma("a step between forward-process times")

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self._one_sigma("the forward process")

    def recover_clean(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self._one_sigma("the forward process")

    def log_prob_gradient_scale(self, steps: list[int]) -> torch.Tensor:
        self._one_sigma("Flash-GRPO's temporal gradient rectification")

    def check_schedule(self, steps: list[int]) -> None:
        trainable = torch.tensor(steps, dtype=torch.long)
        if len(trainable) > 0:  # (one element per stream: the step of (len(steps), S) probes at each stream's σ)
            zeros, sigmas = torch.zeros(len(trainable), len(self.segments)), self.stream_sigmas
            std = flow_sde_step(
                zeros, zeros, self.stream_sigma(trainable), self.stream_sigma(trainable + 1),
                sde_type=self.settings.sde_type, eta=self.settings.eta, prev_sample=zeros, compute_log_prob=False,
                sigma_max=sigmas[:, 1].expand_as(zeros), sigma_min=sigmas[:, -1].expand_as(zeros),
            ).std  # fmt: skip
            bad = (std <= 0).reshape(len(trainable), -1).any(dim=1)
            if bad.any():
                raise ValueError(
                    f"steps {trainable[bad].tolist()} of the {self.num_steps}-step schedules have zero standard "
                    f"deviation in some stream (noise level {self.settings.eta}, sde_type "
                    f"{self.settings.sde_type!r}): their log-probability is undefined"
                )

    def predicted_clean(
        self, model_output: torch.Tensor, latents: torch.Tensor, step_index: torch.Tensor
    ) -> torch.Tensor:
        """x̂0 = x_σ − σ·v with each element's stream σ, (B, ...) float32."""
        return latents.float() - self.element_sigma(step_index, latents) * model_output.float()

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
        segments: Segments = None,
    ) -> SDEStepOutput:
        step_index = step_index.to(latents.device)
        at = functools.partial(self.element_sigma, like=latents)
        last = torch.full_like(step_index, self.num_steps)
        return flow_sde_step(
            model_output,
            latents,
            at(step_index),
            at(step_index + 1),
            sde_type=self.settings.sde_type,
            eta=self.settings.eta if eta is None else eta,
            prev_sample=prev_sample,
            generator=generator,
            sigma_max=at(torch.ones_like(step_index)),
            sigma_min=at(last),
            reduction=self.settings.log_prob_reduction,
            compute_log_prob=compute_log_prob,
            noise=noise,
            segments=segments,
        )


class VPProcess(DiffusionProcess):
    """The variance-preserving process of an ε-, v- or x0-prediction UNet, sampled with DDIM-η steps (DDPO) on a
    ``DDIMScheduler`` built from the pipeline's scheduler config (whatever scheduler it ships: PNDM for SD1.5, Euler
    for SDXL); the ``prediction_type`` is read from that config and converted in every step."""

    def __init__(self, scheduler, settings: SamplerSettings):
        super().__init__(settings)
        config, name = scheduler.config, type(scheduler).__name__
        self.prediction_type = config.get("prediction_type", "epsilon")
        if self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(
                f"{name}'s prediction_type {self.prediction_type!r} is not supported; use one of {PREDICTION_TYPES}"
            )
        if config.get("thresholding", False):
            raise ValueError(
                f"{name} sets thresholding=True: dynamic thresholding of x̂0 is not supported by the DDIM-η step; set "
                "thresholding=False in the pipeline's scheduler config"
            )
        # clip_sample as the given config says; a config without it (PNDM, Euler) does not clip, whatever DDIM's
        # default.
        clip = bool(config.get("clip_sample", False))
        self.scheduler = DDIMScheduler.from_config(config, clip_sample=clip, thresholding=False)
        self.clip_sample_range = self.scheduler.config.clip_sample_range if clip else None
        self.scheduler.set_timesteps(settings.num_inference_steps)
        self.timesteps = self.scheduler.timesteps.to(torch.long).clone()
        self.alpha_prod_t, self.alpha_prod_t_prev = ddim_alpha_pairs(self.scheduler)

    def model_timestep(self, step_index: torch.Tensor) -> torch.Tensor:
        return self.timesteps.to(step_index.device)[step_index]

    def timestep_at(self, t: torch.Tensor) -> torch.Tensor:
        """The training timestep round(t·(T − 1))."""
        return (t * (self.scheduler.config.num_train_timesteps - 1)).round().long()

    def _alpha_bar(self, t: torch.Tensor) -> torch.Tensor:
        return self.scheduler.alphas_cumprod.to(t.device)[self.timestep_at(t)]

    def noise_coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vp_coefficients(self._alpha_bar(t))

    def training_target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return diffusion_target(x0, noise, per_sample(self._alpha_bar(t), x0), self.prediction_type)

    def sample_training_times(
        self,
        count: int,
        generator: torch.Generator | None,
        device: torch.device | str,
        density: TimeDensity = UNIFORM,
    ) -> torch.Tensor:
        """A uniform training timestep in [0, T_train), as t = timestep / (T_train − 1) (DDPM's training)."""
        steps = self.scheduler.config.num_train_timesteps
        return torch.randint(0, steps, (count,), generator=generator, device=device) / (steps - 1)

    def deterministic_step(
        self, model_output: torch.Tensor, latents: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor
    ) -> torch.Tensor:
        step = ddim_sde_step(
            model_output, latents, self._alpha_bar(t), self._alpha_bar(t_next), eta=0.0,
            prediction_type=self.prediction_type, clip_sample_range=self.clip_sample_range, compute_log_prob=False,
            noise=torch.zeros_like(latents),
        )  # fmt: skip
        return step.prev_sample

    def predicted_clean(
        self, model_output: torch.Tensor, latents: torch.Tensor, step_index: torch.Tensor
    ) -> torch.Tensor:
        """DDIM's x̂0 from the network's ε, v or x0 at step ``step_index``, (B, ...) float32."""
        alpha = self.alpha_prod_t.to(latents.device)[step_index].view(-1, *[1] * (latents.ndim - 1))
        return epsilon_and_x0(model_output, latents, alpha, self.prediction_type)[1]

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
        segments: Segments = None,
    ) -> SDEStepOutput:
        device = latents.device
        return ddim_sde_step(
            model_output,
            latents,
            self.alpha_prod_t.to(device)[step_index],
            self.alpha_prod_t_prev.to(device)[step_index],
            eta=self.settings.eta if eta is None else eta,
            prediction_type=self.prediction_type,
            clip_sample_range=self.clip_sample_range,
            prev_sample=prev_sample,
            generator=generator,
            reduction=self.settings.log_prob_reduction,
            compute_log_prob=compute_log_prob,
            noise=noise,
            segments=segments,
        )


def require_flow(process: DiffusionProcess, what: str, hint: str = "") -> FlowProcess:
    """``process`` if it is a :class:`FlowProcess`, else a ``ValueError``: ``what`` needs flow-matching models
    (then ``hint``)."""
    if not isinstance(process, FlowProcess):
        raise ValueError(
            f"{what} needs flow-matching models (FLUX, SD3, Wan, ...); this one predicts {process.prediction_type} "
            f"(SD1.x/SDXL){hint}"
        )
    return process


__all__ = ["DiffusionProcess", "FlowProcess", "StreamFlowProcess", "TimestepUnits", "VPProcess", "require_flow"]
