"""Policy-gradient losses on denoising transitions (pure tensor math, ALGORITHMS.md §6, ALGORITHMS-NEXT.md §2.6)."""

from __future__ import annotations

import torch


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float | None = None
) -> torch.Tensor:
    """PPO's clipped objective, negated: ``max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε_high))`` per transition, (B,).

    ``epsilon_high`` (default ``epsilon``) is TRL's asymmetric upper bound."""
    high = epsilon if epsilon_high is None else epsilon_high
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - epsilon, 1 + high))


def clipped_fraction(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float | None = None
) -> torch.Tensor:
    """(B,) 1.0 where the clip is active (the gradient is cut), else 0.0."""
    high = epsilon if epsilon_high is None else epsilon_high
    return (((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))).float()


def normalized_log_ratio(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob_of_old_mean: torch.Tensor,
    log_prob_of_mean: torch.Tensor,
    std: torch.Tensor,
) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio ``s·(ℓ − ℓ_old + R((μ − μ_old)²)/(2s²))`` per transition, (B,).

    For a Gaussian step ``x ~ N(μ, s²)`` with reduction R (mean or sum over the latent), ``ℓ(y) − ℓ(μ) =
    −R((y − μ)²)/(2s²)``, so the bias term is ``ℓ(μ) − ℓ(μ_old)`` under the current mean μ, which the caller evaluates
    with the same step function as ``log_prob`` (hence on the same latent elements). With ``x = μ_old + s·z`` from the
    rollout the result equals ``R(z·(μ − μ_old))``: zero-mean under the rollout noise, 0 at θ = θ_old, and free of
    the 1/s factor that blows up the plain log-ratio at low-noise steps.

    Args:
        log_prob, old_log_prob: (B,) ℓ of the rollout's next latent under the current and the rollout policy.
        log_prob_of_old_mean: (B,) ℓ(μ_old) under the current policy's Gaussian.
        log_prob_of_mean: (B,) ℓ(μ) under the current policy's Gaussian (−log s − ½log 2π for the mean reduction).
        std: (B,) the transition's standard deviation s.
    """
    return std * (log_prob - old_log_prob + log_prob_of_mean - log_prob_of_old_mean)


__all__ = ["clipped_fraction", "clipped_surrogate", "normalized_log_ratio"]
