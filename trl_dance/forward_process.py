"""The forward process x_t = α_t·x0 + σ_t·ε (pure tensor math): noising clean latents, recovering them from a known
noise, and the step of a deterministic sampler between two times.

Every family addresses it by a time t ∈ [0, 1] (1: pure noise), through its policy's process
(:class:`~trl_dance.policies.FlowProcess` or :class:`~trl_dance.policies.VPProcess`: ``policy.process.add_noise`` and
its neighbours), which is the parametrisation:

- flow matching (FLUX, SD3, Wan, ...): σ = t, ``(α, σ) = (1 − t, t)``, the model predicts the velocity ε − x0;
- variance preserving (SD1.x/2.x, SDXL): the training timestep ``round(t·(T − 1))``, ``(α, σ) = (√ᾱ, √(1 − ᾱ))``, the
  model predicts ε, v = α·ε − σ·x0 or x0 (:func:`trl_dance.sde.diffusion_target`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TimeDensity:
    """How training times are drawn (diffusers' ``compute_density_for_timestep_sampling``): u ~ U(0, 1) (``"none"``),
    sigmoid(N(logit_mean, logit_std)) (``"logit_normal"``) or the SD3 paper's ``"mode"`` density."""

    scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29


UNIFORM = TimeDensity()


def per_sample(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (B,) as ``like``'s dtype and device, viewed (B, 1, ..., 1) to broadcast against it."""
    return value.to(like).view(-1, *([1] * (like.ndim - 1)))


def add_noise(x0: torch.Tensor, noise: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``α·x0 + σ·ε`` per sample: (B, ...) ``x0`` and ``noise``, (B,) ``alpha`` and ``sigma``."""
    return per_sample(alpha, x0) * x0 + per_sample(sigma, x0) * noise


def recover_clean(
    latents: torch.Tensor, noise: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor
) -> torch.Tensor:
    """``(x_t − σ·ε)/α``: the clean latents of ``latents`` (B, ...) given their *known* noise (Direct-Align's analytic
    x̂0), the inverse of :func:`add_noise`; (B,) ``alpha`` > 0."""
    return (latents - per_sample(sigma, latents) * noise) / per_sample(alpha, latents)


def flow_coefficients(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(1 − σ, σ)``: rectified flow's interpolation ``x_σ = (1 − σ)·x0 + σ·ε``."""
    return 1 - sigma, sigma


def vp_coefficients(alpha_bar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(√ᾱ, √(1 − ᾱ))``: the variance-preserving process at the cumulative product ᾱ_t."""
    return alpha_bar.sqrt(), (1 - alpha_bar).sqrt()


def renoise_interval(
    x_s: torch.Tensor, noise: torch.Tensor, sigma_s: torch.Tensor, sigma_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RTDMD's sub-interval re-noising (ALGORITHMS-NEXT §2.17.2) of a rectified-flow sample ``x_s`` at σ_s to σ_t > σ_s:
    ``x_t = a·x_s + σ_ts·n`` with a = (1 − σ_t)/(1 − σ_s) and σ_ts = √(σ_t² − a²σ_s²), so that x_t is distributed as
    the forward process at σ_t of x_s's clean sample; and the velocity of that path at fixed (x_s, n),
    ``u* = dx_t/dσ_t = −x_s/(1 − σ_s) + (σ_t + (1 − σ_t)·σ_s²/(1 − σ_s)²)/σ_ts · n`` (the "ambient" target of a score
    trained on noisy data). At σ_s = 0: x_t = (1 − σ_t)·x0 + σ_t·n and u* = n − x0, flow matching's.

    Args:
        x_s, noise: (B, ...); sigma_s (B,) in [0, 1), sigma_t (B,) in (σ_s, 1].
    Returns:
        (x_t, u*) (B, ...) float32 and σ_ts (B,) float32.
    """
    x_s, noise = x_s.float(), noise.float()
    sigma_s, sigma_t = sigma_s.float(), sigma_t.float()
    a = (1 - sigma_t) / (1 - sigma_s)
    sigma_ts = (sigma_t**2 - (a * sigma_s) ** 2).clamp_min(0).sqrt()
    x_t = per_sample(a, x_s) * x_s + per_sample(sigma_ts, x_s) * noise
    # (σ_t = σ_s exactly, a draw of probability ~2⁻²⁴, would divide by 0; the loss weights u* by σ_ts² anyway)
    growth = (sigma_t + (1 - sigma_t) * sigma_s**2 / (1 - sigma_s) ** 2) / sigma_ts.clamp_min(1e-6)
    target = -x_s / per_sample(1 - sigma_s, x_s) + per_sample(growth, x_s) * noise
    return x_t, target, sigma_ts


def euler_step(latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor):
    """``x_σ' = x_σ + (σ' − σ)·v`` with (B,) σ, σ': toward less noise when σ' < σ (denoising), toward more when σ' > σ
    (inversion). The exact velocity ε − x0 moves along :func:`add_noise`'s line."""
    return latents + per_sample(sigma_next - sigma, latents) * velocity
