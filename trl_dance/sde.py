"""Stochastic denoising steps with exact Gaussian log-probabilities.

Pure tensor math, no model code. Conventions (see ALGORITHMS.md §2-3):

* Rectified flow: ``x_σ = (1 − σ) x0 + σ ε``; ``σ = 1`` is pure noise, ``σ = 0`` is data. The network predicts the
  velocity ``v ≈ ε − x0``. A step goes from ``σ`` to ``σ_next < σ``.
* ε-prediction diffusion: ``x_t = sqrt(ᾱ_t) x0 + sqrt(1 − ᾱ_t) ε``; the network predicts ``ε``.

Every function computes in float32 whatever the input dtype, and returns float32 tensors. Batch is the first
dimension of ``sample``; ``log_prob`` is reduced over all the other dimensions (mean by default, which is the
convention the published clip range 1e-4 is tuned for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

SDEType = Literal["dance", "flow_grpo", "cps", "flash"]
Reduction = Literal["mean", "sum"]
Segments = tuple[int, ...] | None
"""Sizes of consecutive runs of a flattened sample (summing to its size), one per stream of a multi-stream latent
(LTX-2's video then audio tokens), or None for one stream."""
PredictionType = Literal["epsilon", "v_prediction", "sample"]
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class SDEStepOutput:
    """Result of one stochastic step.

    Attributes:
        prev_sample: (B, ...) float32, the next, less noisy latent (sampled, or the one that was scored).
        log_prob: (B,) float32 log-density of ``prev_sample`` under the step's Gaussian, reduced over non-batch
            dims (given ``segments``, (B, S): each stream's over its own elements, see :func:`reduce_per_sample`);
            ``None`` when not requested. For ``sde_type="cps"`` it is the published pseudo log-prob
            ``−reduce((prev_sample − mean)²)``.
        mean: (B, ...) float32 mean of the Gaussian transition.
        std: (B,) float32 standard deviation of the transition (isotropic); (B, ...) per element where σ is given per
            element (streams on their own σ grids, :class:`~trl_dance.policies.process.StreamFlowProcess`).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    mean: torch.Tensor
    std: torch.Tensor


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A float or (B,) tensor as a float32 tensor of shape (B, 1, ..., 1) broadcastable against ``like``; a tensor of
    ``like``'s own shape (one value per element: streams on their own σ grids) as it is."""
    batch = like.shape[0]
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim > 1 and value.shape == like.shape:
        return value
    if value.ndim == 0:
        value = value.expand(batch)
    if value.shape != (batch,):
        raise ValueError(f"expected a float or a tensor of shape ({batch},), got shape {tuple(value.shape)}")
    return value.view(batch, *([1] * (like.ndim - 1)))


def reduce_per_sample(values: torch.Tensor, reduction: Reduction = "mean", segments: Segments = None) -> torch.Tensor:
    """(B, ...) per-element values reduced over each sample's elements, their mean or sum: (B,); with ``segments``
    (B, S), each stream's over its own elements (:func:`join_streams` gives back the one-stream reduction)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if segments is None:
        dims = tuple(range(1, values.ndim))
        return values.mean(dim=dims) if reduction == "mean" else values.sum(dim=dims)
    flat = values.flatten(1)
    if sum(segments) != flat.shape[1]:
        raise ValueError(f"segments {segments} do not add up to the {flat.shape[1]} elements of a sample")
    parts = flat.split(list(segments), dim=1)
    return torch.stack([part.mean(dim=1) if reduction == "mean" else part.sum(dim=1) for part in parts], dim=1)


def join_streams(per_stream: torch.Tensor, segments: tuple[int, ...], reduction: Reduction = "mean") -> torch.Tensor:
    """(B, S) per-stream reductions (:func:`reduce_per_sample` with ``segments``) to the one-stream reduction (B,): the
    sum, or for the mean the streams' means weighted by their share of the elements."""
    if reduction == "sum":
        return per_stream.sum(dim=1)
    shares = torch.tensor(segments, dtype=per_stream.dtype, device=per_stream.device)
    return (per_stream * shares).sum(dim=1) / shares.sum()


def _gaussian_step(
    mean: torch.Tensor,
    std: torch.Tensor,
    prev_sample: torch.Tensor | None,
    generator: torch.Generator | None,
    compute_log_prob: bool,
    reduction: Reduction,
    pseudo_log_prob: bool = False,
    noise: torch.Tensor | None = None,
    segments: Segments = None,
) -> SDEStepOutput:
    """Sample (or score) ``prev_sample ~ N(mean, std² I)``; ``std`` has shape (B, 1, ..., 1)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(
                mean.shape,
                generator=generator,
                dtype=torch.float32,
                device=generator.device if generator is not None else mean.device,
            )
        elif noise.shape != mean.shape:
            raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {tuple(mean.shape)}")
        prev_sample = mean + std * noise.to(device=mean.device, dtype=torch.float32)
    else:
        if prev_sample.shape != mean.shape:
            raise ValueError(f"prev_sample has shape {tuple(prev_sample.shape)}, expected {tuple(mean.shape)}")
        prev_sample = prev_sample.detach().to(torch.float32)

    log_prob = None
    if compute_log_prob:
        if pseudo_log_prob:
            per_element = -((prev_sample - mean) ** 2)
        else:
            per_element = -((prev_sample - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
        log_prob = reduce_per_sample(per_element, reduction, segments)
    per_element = std.shape == mean.shape and mean[0].numel() > 1
    return SDEStepOutput(
        prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std if per_element else std.flatten()
    )


def _check_eta(eta: float, compute_log_prob: bool) -> None:
    # Only the scalar is checked: testing the per-sample std would cost a host-device sync every step. A schedule's
    # zero-width steps (σ_next = σ, or CPS onto σ = 0) are found once by DiffusionProcess.check_schedule.
    if compute_log_prob and eta <= 0:
        raise ValueError(
            f"noise level {eta} gives the step zero standard deviation: its log-probability is undefined. "
            "Use a positive noise level, or compute_log_prob=False for the deterministic step."
        )


def flow_sde_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    sde_type: SDEType = "dance",
    eta: float = 0.3,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | torch.Tensor | None = None,
    sigma_min: float | torch.Tensor = 0.0,
    reduction: Reduction = "mean",
    compute_log_prob: bool = True,
    noise: torch.Tensor | None = None,
    segments: Segments = None,
) -> SDEStepOutput:
    """One stochastic rectified-flow step from ``sigma`` to ``sigma_next`` with its log-probability.

    Args:
        model_output: (B, ...) predicted velocity ``v ≈ ε − x0``.
        sample: (B, ...) current latent ``x_σ``.
        sigma, sigma_next: noise levels in [0, 1], ``sigma > sigma_next``; floats, (B,) tensors, or tensors of
            ``sample``'s shape (one level per element; ``sigma_max`` and ``sigma_min`` then too).
        sde_type: ``"dance"`` (constant diffusion ``s = eta``, DanceGRPO), ``"flow_grpo"``
            (``s = eta · sqrt(σ / (1 − σ̃))``, ``σ̃ = sigma_max`` where ``σ = 1``), ``"flash"`` (Flash-GRPO,
            arXiv 2605.15980: ``s = eta · (σ_min + (σ_max − σ_min) · σ)``, linear in σ, with the schedule's
            ``sigma_max`` and ``sigma_min``; η = 1 is the paper's), or ``"cps"`` (coefficients-preserving sampling,
            ``std = σ_next · sin(eta · π/2)``, pseudo log-prob).
        eta: η for ``dance`` and ``flash``, ``a`` for ``flow_grpo`` and ``cps``. 0 gives the deterministic Euler step.
        prev_sample: if given, it is scored (detached) instead of sampling a new one.
        generator: random generator for the sampled noise.
        sigma_max: for ``flow_grpo``, the grid value after 1 (``σ_1``), used where ``σ = 1``; for ``flash``, σ_max
            (Flash-GRPO takes the same grid value, ``σ_1``).
        sigma_min: for ``flash``, σ_min (the grid's last value: 0 on flow-matching schedules).
        reduction: ``"mean"`` or ``"sum"`` of the per-element log-density over non-batch dims.
        segments: the streams' sizes, for a (B, S) ``log_prob``, each stream's (:func:`reduce_per_sample`).
        compute_log_prob: set False to skip the log-prob. Required for a zero-noise step: noise level 0 raises;
            a zero-width step (σ_next = σ, or CPS onto σ = 0) would give an infinite log-prob.
        noise: (B, ...) standard normal noise to use instead of drawing from ``generator`` (e.g. drawn per sample).

    Returns:
        :class:`SDEStepOutput` with float32 tensors.
    """
    _check_eta(eta, compute_log_prob)
    v = model_output.to(torch.float32)
    x = sample.to(torch.float32)
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    delta = s - s_next
    x0_hat = x - s * v
    eps_hat = x + (1 - s) * v

    if sde_type == "cps":
        std = s_next * math.sin(eta * math.pi / 2)
        mean = (1 - s_next) * x0_hat + torch.sqrt((s_next**2 - std**2).clamp_min(0)) * eps_hat
        return _gaussian_step(mean, std, prev_sample, generator, compute_log_prob, reduction, True, noise, segments)

    if sde_type == "dance":
        diffusion = torch.full_like(s, float(eta))
    elif sde_type == "flow_grpo":
        if sigma_max is None and bool((s >= 1).any()):
            raise ValueError("sde_type='flow_grpo' at sigma = 1 needs sigma_max, the next value of the sigma grid")
        s_tilde = torch.where(s >= 1, _per_sample(sigma_max if sigma_max is not None else 0.0, x), s)
        diffusion = eta * torch.sqrt(s / (1 - s_tilde))
    elif sde_type == "flash":
        if sigma_max is None:
            raise ValueError("sde_type='flash' needs sigma_max (Flash-GRPO: the sigma grid's value after 1)")
        low = _per_sample(sigma_min, x)
        diffusion = eta * (low + (_per_sample(sigma_max, x) - low) * s)
    else:
        raise ValueError(f"sde_type must be 'dance', 'flow_grpo', 'cps' or 'flash', got {sde_type!r}")

    mean = x - delta * (v + diffusion**2 / (2 * s) * eps_hat)
    std = diffusion * torch.sqrt(delta)
    return _gaussian_step(
        mean, std, prev_sample, generator, compute_log_prob, reduction, noise=noise, segments=segments
    )


def _check_prediction_type(prediction_type: str) -> None:
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")


def epsilon_and_x0(
    model_output: torch.Tensor, sample: torch.Tensor, alpha_prod_t: torch.Tensor, prediction_type: PredictionType
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ε̂, x̂0)`` from a diffusion model's output at ``x_t = √ᾱ x0 + √(1 − ᾱ) ε``, float32.

    Args:
        model_output: (B, ...) the network's ε (``"epsilon"``), ``v = √ᾱ ε − √(1 − ᾱ) x0`` (``"v_prediction"``, SD 2.x
            768) or x0 (``"sample"``).
        sample: (B, ...) ``x_t``.
        alpha_prod_t: ``ᾱ_t`` broadcastable to ``sample`` (B, 1, ..., 1).
    """
    _check_prediction_type(prediction_type)
    out, x, a = model_output.to(torch.float32), sample.to(torch.float32), alpha_prod_t
    if prediction_type == "epsilon":
        return out, (x - torch.sqrt(1 - a) * out) / torch.sqrt(a)
    if prediction_type == "v_prediction":
        return torch.sqrt(a) * out + torch.sqrt(1 - a) * x, torch.sqrt(a) * x - torch.sqrt(1 - a) * out
    return (x - torch.sqrt(a) * out) / torch.sqrt(1 - a), out


def diffusion_target(
    x0: torch.Tensor, noise: torch.Tensor, alpha_prod_t: torch.Tensor, prediction_type: PredictionType
) -> torch.Tensor:
    """What a diffusion model of ``prediction_type`` is trained to output at ``x_t = √ᾱ x0 + √(1 − ᾱ) noise``: ε,
    ``v = √ᾱ ε − √(1 − ᾱ) x0`` or x0 (the inverse of :func:`epsilon_and_x0`). ``alpha_prod_t`` broadcasts to x0."""
    _check_prediction_type(prediction_type)
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return torch.sqrt(alpha_prod_t) * noise - torch.sqrt(1 - alpha_prod_t) * x0
    return x0


def ddim_sde_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    alpha_prod_t: float | torch.Tensor,
    alpha_prod_t_prev: float | torch.Tensor,
    *,
    eta: float = 1.0,
    prediction_type: PredictionType = "epsilon",
    clip_sample_range: float | None = None,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    reduction: Reduction = "mean",
    compute_log_prob: bool = True,
    noise: torch.Tensor | None = None,
    segments: Segments = None,
) -> SDEStepOutput:
    """One DDIM step with noise ``eta`` (DDPO) for diffusion models, with its log-probability.

    Args:
        model_output: (B, ...) the network's output, converted by :func:`epsilon_and_x0` per ``prediction_type``.
        sample: (B, ...) current latent ``x_t``.
        alpha_prod_t, alpha_prod_t_prev: cumulative alphas ``ᾱ_t`` and ``ᾱ_{t'}`` in (0, 1]; floats or (B,).
        eta: DDIM η; 0 is the deterministic DDIM step, 1 the DDPM-like posterior variance.
        prediction_type: ``"epsilon"`` (SD1.x, SDXL), ``"v_prediction"`` (SD 2.x 768) or ``"sample"``.
        clip_sample_range: clamp x̂0 to ``[−r, r]`` (a scheduler's ``clip_sample``), ε̂ kept as predicted, as
            ``DDIMScheduler.step`` does; the transition stays Gaussian, its mean a function of the clamped x̂0.
        prev_sample, generator, reduction, compute_log_prob, noise, segments: as in :func:`flow_sde_step`.
    """
    _check_eta(eta, compute_log_prob)
    x = sample.to(torch.promote_types(sample.dtype, torch.float32))  # float32 (float64 stays, for gradient checks)
    a_t = _per_sample(alpha_prod_t, x)
    a_prev = _per_sample(alpha_prod_t_prev, x)
    eps, x0_hat = epsilon_and_x0(model_output, x, a_t, prediction_type)
    if clip_sample_range is not None:
        x0_hat = x0_hat.clamp(-clip_sample_range, clip_sample_range)
    variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    std = eta * torch.sqrt(variance.clamp_min(0))
    mean = torch.sqrt(a_prev) * x0_hat + torch.sqrt((1 - a_prev - std**2).clamp_min(0)) * eps
    return _gaussian_step(
        mean, std, prev_sample, generator, compute_log_prob, reduction, noise=noise, segments=segments
    )


def dance_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """DanceGRPO's shifted schedule: ``σ_k = s·u / (1 + (s − 1)·u)``, ``u = 1 − k/N``, ``k = 0..N``.

    Returns:
        (num_steps + 1,) float32, from exactly 1 down to exactly 0.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    u = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * u / (1 + (shift - 1) * u)).to(torch.float32)


def flow_dpm_solver_step(
    x0_hat: torch.Tensor,
    sample: torch.Tensor,
    sigma: float,
    sigma_next: float,
    previous: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """One deterministic DPM-Solver++ step of a rectified flow (``α = 1 − σ``), second order (2M, midpoint) when the
    previous step's data prediction is given, else first order; onto ``σ_next = 0`` it returns ``x̂0`` (first order, as
    diffusers' ``DPMSolverMultistepScheduler`` with ``final_sigmas_type="zero"``).

    With ``λ(σ) = log((1 − σ)/σ)``, ``h = λ(σ_next) − λ(σ)``:
    ``x' = (σ_next/σ)·x − (1 − σ_next)(e^{−h} − 1)·D``, ``D = x̂0`` (first order) or
    ``D = (1 + 1/(2r))·x̂0 − 1/(2r)·x̂0_prev`` with ``r = (λ(σ) − λ(σ_prev))/h``.

    Args:
        x0_hat: (B, ...) the data prediction ``x − σ v`` at ``sample``.
        sample: (B, ...) the latent at ``sigma``.
        sigma, sigma_next: noise levels, ``1 >= sigma > sigma_next >= 0``.
        previous: ``(x̂0_prev, σ_prev)`` of the solver's previous step, or None.

    Returns:
        (B, ...) float32 latent at ``sigma_next``.
    """
    x0 = x0_hat.to(torch.float32)
    if sigma_next <= 0:
        return x0
    if not 0 < sigma_next < sigma <= 1:
        raise ValueError(f"need 1 >= sigma > sigma_next > 0, got sigma={sigma}, sigma_next={sigma_next}")
    if sigma == 1:  # λ = −∞: the first-order step is exact Euler, x' = σ_next·x + (1 − σ_next)·x̂0
        return sigma_next * sample.to(torch.float32) + (1 - sigma_next) * x0

    def lam(s: float) -> float:
        return math.log((1 - s) / s)

    h = lam(sigma_next) - lam(sigma)
    data = x0
    if previous is not None and previous[1] < 1:  # after a step from σ = 1, r = ∞: first order
        x0_prev, sigma_prev = previous
        r = (lam(sigma) - lam(sigma_prev)) / h
        data = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * x0_prev.to(torch.float32)
    return (sigma_next / sigma) * sample.to(torch.float32) - (1 - sigma_next) * math.expm1(-h) * data
