"""Bridges from configured diffusers schedulers to the pure math of :mod:`trl_dance.sde`.

The trainers pass σ tables and ᾱ pairs to the step functions explicitly; these helpers read them off a scheduler
once (after ``set_timesteps``), and :func:`patch_scheduler` gives a scheduler a ``step_with_logprob`` method for
users who keep their own sampling loops.
"""

from __future__ import annotations

import types

import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

from .sde import SDEStepOutput, SDEType, ddim_sde_step, flow_sde_step


def flow_match_sigmas(scheduler: FlowMatchEulerDiscreteScheduler) -> torch.Tensor:
    """The σ table of a scheduler after ``set_timesteps``: (N + 1,) float32 on CPU, ending with the terminal σ."""
    if (
        scheduler.sigmas is None
        or scheduler.timesteps is None
        or len(scheduler.sigmas) != len(scheduler.timesteps) + 1
    ):
        raise ValueError("call scheduler.set_timesteps(...) before reading its sigma table")
    return scheduler.sigmas.detach().to("cpu", torch.float32).clone()


def ddim_alpha_pairs(
    scheduler: DDIMScheduler, timesteps: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cumulative alphas ``(ᾱ_t, ᾱ_{t'})`` for DDIM timesteps, as ``DDIMScheduler.step`` and DDPO compute them.

    ``t' = t − T_train / N``; where ``t' < 0`` (the last step) ``ᾱ_{t'}`` is the scheduler's ``final_alpha_cumprod``
    (``ᾱ_0`` with ``set_alpha_to_one=False``, the Stable Diffusion setting; 1 otherwise).

    Args:
        scheduler: a ``DDIMScheduler`` after ``set_timesteps``.
        timesteps: (N,) integer timesteps; defaults to ``scheduler.timesteps``.

    Returns:
        Two (N,) float32 CPU tensors.
    """
    if scheduler.num_inference_steps is None:
        raise ValueError("call scheduler.set_timesteps(...) before reading its alphas")
    timesteps = scheduler.timesteps if timesteps is None else torch.as_tensor(timesteps)
    timesteps = timesteps.to("cpu", torch.long)
    num_train = scheduler.config.num_train_timesteps
    prev = timesteps - num_train // scheduler.num_inference_steps
    alphas = scheduler.alphas_cumprod.to("cpu", torch.float32)
    final = torch.as_tensor(scheduler.final_alpha_cumprod, dtype=torch.float32)
    return alphas[timesteps], torch.where(prev >= 0, alphas[prev.clamp(0, num_train - 1)], final)


def _step_indices(scheduler: FlowMatchEulerDiscreteScheduler, timestep: float | torch.Tensor) -> torch.Tensor:
    """Index into ``scheduler.timesteps`` of each given timestep (scalar or (B,)), by nearest match."""
    grid = scheduler.timesteps.to("cpu", torch.float32)
    t = torch.as_tensor(timestep, dtype=torch.float32).to("cpu").reshape(-1)
    return (t[:, None] - grid[None, :]).abs().argmin(dim=1)


def patch_scheduler(
    scheduler: FlowMatchEulerDiscreteScheduler | DDIMScheduler,
    sde_type: SDEType = "dance",
    eta: float | None = None,
):
    """Give ``scheduler`` a stateless ``step_with_logprob(model_output, timestep, sample, prev_sample=None,
    generator=None) -> SDEStepOutput``; its ordinary ``step`` is left untouched.

    Args:
        scheduler: a ``FlowMatchEulerDiscreteScheduler`` (velocity models) or ``DDIMScheduler`` (ε models), on which
            ``set_timesteps`` has been or will be called before stepping.
        sde_type: for flow-matching schedulers, ``"dance"``, ``"flow_grpo"``, ``"cps"`` or ``"flash"``; ignored for DDIM.
        eta: η (dance), ``a`` (flow_grpo, cps) or DDIM's η; defaults to 0.3 for flow, 1.0 for DDIM.

    Returns:
        The same scheduler instance.
    """
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        level = 0.3 if eta is None else eta

        def step_with_logprob(self, model_output, timestep, sample, prev_sample=None, generator=None) -> SDEStepOutput:
            sigmas = flow_match_sigmas(self)
            index = _step_indices(self, timestep)
            if bool((index >= len(sigmas) - 1).any()):
                raise ValueError(f"timestep {timestep} is past the last step of the schedule")
            device = sample.device
            return flow_sde_step(
                model_output,
                sample,
                sigmas[index].to(device).expand(sample.shape[0]),
                sigmas[index + 1].to(device).expand(sample.shape[0]),
                sde_type=sde_type,
                eta=level,
                prev_sample=prev_sample,
                generator=generator,
                sigma_max=float(sigmas[1]) if len(sigmas) > 2 else None,
                sigma_min=float(sigmas[-1]),
            )

    elif isinstance(scheduler, DDIMScheduler):
        level = 1.0 if eta is None else eta

        def step_with_logprob(self, model_output, timestep, sample, prev_sample=None, generator=None) -> SDEStepOutput:
            t = torch.as_tensor(timestep).reshape(-1)
            alpha_t, alpha_prev = ddim_alpha_pairs(self, t)
            device = sample.device
            return ddim_sde_step(
                model_output,
                sample,
                alpha_t.to(device).expand(sample.shape[0]),
                alpha_prev.to(device).expand(sample.shape[0]),
                eta=level,
                prediction_type=self.config.prediction_type,
                clip_sample_range=self.config.clip_sample_range if self.config.clip_sample else None,
                prev_sample=prev_sample,
                generator=generator,
            )

    else:
        raise TypeError(
            f"patch_scheduler supports FlowMatchEulerDiscreteScheduler and DDIMScheduler, got {type(scheduler).__name__}"
        )

    scheduler.step_with_logprob = types.MethodType(step_with_logprob, scheduler)
    return scheduler
