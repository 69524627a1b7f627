"""Losses on denoising transitions and preference pairs (pure tensor math, ALGORITHMS.md §4, §6, ALGORITHMS-NEXT.md §2.6)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .sde import Segments


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


def dppo_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, kl: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-DPPO's objective, negated: ``−A·ρ·keep`` per transition (B,), and ``keep`` (B,) as 0/1 floats.

    ``keep`` is 0 where the transition left the trust region (``kl`` ≥ ``threshold``, the exact KL of the old and new
    step Gaussians) *in the direction its advantage pushes* (ρ > 1 with A > 0, or ρ < 1 with A < 0): there the gradient
    stops, as PPO's clip stops it outside [1 − ε, 1 + ε]; a step back toward the old policy keeps its gradient."""
    further = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
    keep = (~((kl >= threshold) & further)).to(ratio.dtype)
    return -advantages * ratio * keep, keep


def importance_weight(
    log_weight: torch.Tensor, mode: str, clip_max: float, clip_min: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's behaviour correction (AReaL; TRL's ``vllm_importance_sampling_*``), per transition (B,):
    ``w = exp(log π_prox − log μ)`` of the proximal (round-start) policy over the behaviour policy that sampled the
    transition, detached; ``"truncate"`` caps it to [``clip_min``, ``clip_max``], ``"mask"`` zeroes it outside.
    Returns (w, kept) with ``kept`` 0/1 floats (0 where ``"mask"`` dropped the transition)."""
    weight = torch.exp(log_weight.detach())
    low = 0.0 if clip_min is None else clip_min
    inside = (weight >= low) & (weight <= clip_max)
    if mode == "truncate":
        return weight.clamp(low, clip_max), torch.ones_like(weight)
    if mode == "mask":
        return weight * inside, inside.to(weight.dtype)
    raise ValueError(f"importance_sampling_mode must be 'truncate' or 'mask', got {mode!r}")


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


def gaussian_step_kl(mean: torch.Tensor, other_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """(B,) KL between two step Gaussians N(mean, std²I) and N(other_mean, std²I) of one (B,) std, per latent element:
    mean((mean − other_mean)²) / (2·std²) over the non-batch dimensions (the exact KL divided by their count); a std
    of ``mean``'s shape (per element) inside the mean."""
    dims = tuple(range(1, mean.ndim))
    if std.shape == mean.shape and mean.ndim > 1:
        return (((mean - other_mean) / std) ** 2).mean(dim=dims) / 2
    return ((mean - other_mean) ** 2).mean(dim=dims) / (2 * std**2)


def optimality_probability(advantages: torch.Tensor, advantage_max: float) -> torch.Tensor:
    """DiffusionNFT's r = clip(½ + A/(2·A_max), 0, 1): the probability that a sample is "positive"."""
    return (0.5 + advantages / (2 * advantage_max)).clamp(0, 1)


def nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    noisy: torch.Tensor,
    x0: torch.Tensor,
    sigma: torch.Tensor,
    r: torch.Tensor,
    beta: float,
    scale: float,
    floor: float = 1e-5,
    segments: Segments = None,
    stream_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """DiffusionNFT's negative-aware loss per sample, (B,).

    With the implicit policies v⁺ = β·v + (1 − β)·sg(v_old) and v⁻ = (1 + β)·sg(v_old) − β·v, their clean-sample
    predictions x̂0± = x_σ − σ·v± are pulled toward x0 with weight r (positive) and 1 − r (negative), each squared error
    divided by its own stop-gradient mean absolute error (floored): ``scale/β · [r·mean((x̂0⁺ − x0)²)/w⁺ +
    (1 − r)·mean((x̂0⁻ − x0)²)/w⁻]`` (the paper's scale is the advantage clip, 5).

    At v = v_old both predictions are x̂0 = x_σ − σ·v_old and the gradient is scale·(2r − 1)·(−2σ)·(x̂0 − x0)/(w·D)
    times ∂v/∂θ: zero when every advantage is 0 (r = ½), advantage-weighted flow matching to first order.

    With ``segments`` (rewards routed per modality, OmniNFT), each stream has its own r_s, weights w±_s and mean over
    its own elements, and the streams' terms, times ``stream_weights`` (0 leaves a stream untrained), are averaged
    (OmniNFT's (L_video + L_audio)/2).

    Args:
        velocity: (B, ...) v_θ at ``noisy`` (with gradient).
        old_velocity: (B, ...) v_old at ``noisy`` (no gradient needed; detached here).
        noisy: (B, ...) x_σ = (1 − σ)·x0 + σ·ε.
        x0: (B, ...) the rollout's clean sample.
        sigma: (B,) noise levels in (0, 1].
        r: (B,) optimality probabilities in [0, 1]; (B, S) with ``segments``.
        beta: NFT's β > 0 (how far the implicit policies sit from the old one).
        scale: the loss scale (the paper: the advantage clip).
        segments: the S streams' element counts in a flattened sample (None: one stream).
        stream_weights: (S,) weights of the streams' terms (default 1).
    """
    shape = (-1,) + (1,) * (x0.ndim - 1)
    s, old = sigma.view(shape).float(), old_velocity.detach().float()
    velocity, noisy, x0 = velocity.float(), noisy.float(), x0.float()
    dims = tuple(range(1, x0.ndim))
    terms = []
    for implicit in (beta * velocity + (1 - beta) * old, (1 + beta) * old - beta * velocity):
        error = noisy - s * implicit - x0
        if segments is None:
            weight = error.detach().abs().mean(dim=dims, keepdim=True).clamp_min(floor)
            terms.append((error**2 / weight).mean(dim=dims))
            continue
        streams = []
        for part in error.flatten(1).split(list(segments), dim=1):
            weight = part.detach().abs().mean(dim=1, keepdim=True).clamp_min(floor)
            streams.append((part**2 / weight).mean(dim=1))
        terms.append(torch.stack(streams, dim=1))
    loss = r * terms[0] + (1 - r) * terms[1]
    if segments is not None:
        loss = (loss if stream_weights is None else loss * stream_weights.to(loss)).mean(dim=1)
    return scale / beta * loss


def flow_matching_error(velocity: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """(B,) the flow-matching loss mean((v − (ε − x0))²) of each sample."""
    dims = tuple(range(1, x0.ndim))
    return ((velocity.float() - (noise.float() - x0.float())) ** 2).mean(dim=dims)


def ambient_velocity_error(
    velocity: torch.Tensor, target: torch.Tensor, sigma_ts: torch.Tensor, cap: float = 10.0
) -> torch.Tensor:
    """RTDMD's fake-score loss on noisy data, (B,): ``min(1, cap·σ_ts²)·mean((v − u*)²)`` (its clamp(1/σ_ts², ≤ cap) on
    the σ_ts-scaled residual): u* (:func:`~trl_dance.forward_process.renoise_interval`) grows like 1/σ_ts as σ_t
    nears σ_s, and the weight keeps that sub-interval's loss bounded."""
    dims = tuple(range(1, target.ndim))
    weight = (cap * sigma_ts.float() ** 2).clamp_max(1.0)
    return weight * ((velocity.float() - target.float()) ** 2).mean(dim=dims)


def consistency_loss(anchor: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """RTDMD's consistency term per sample, (B,): ``mean((h′₁ − h)·(h′₂ − h))`` with h′₁, h′₂ two independent draws
    (detached here): an unbiased estimate of ‖E[h′] − h‖² per element (the product of two independent errors has the
    squared mean error as its expectation); its gradient in h is (2h − h′₁ − h′₂)/D."""
    dims = tuple(range(1, anchor.ndim))
    anchor = anchor.float()
    return ((first.detach().float() - anchor) * (second.detach().float() - anchor)).mean(dim=dims)


AWM_WEIGHTINGS = ("ghuber", "sigma", "uniform")


def awm_surrogate(error: torch.Tensor, sigma: torch.Tensor, weighting: str, power: float = 0.25) -> torch.Tensor:
    """AWM's −log π = w(ℓ, σ) of flow-matching losses ℓ (B,): ``"ghuber"`` σ·((ℓ + ε)^p − ε^p)/p with ε = 1e-10 (AWM's
    default, p = 0.25: a robust loss whose gradient σ·(ℓ + ε)^(p−1) shrinks for large errors), ``"sigma"`` σ·ℓ,
    ``"uniform"`` ℓ."""
    if weighting == "uniform":
        return error
    if weighting == "sigma":
        return sigma.float() * error
    if weighting == "ghuber":
        eps = 1e-10
        return sigma.float() * ((error + eps) ** power - eps**power) / power
    raise ValueError(f"weighting must be one of {AWM_WEIGHTINGS}, got {weighting!r}")


def awm_log_ratio(
    error: torch.Tensor, old_error: torch.Tensor, sigma: torch.Tensor, weighting: str, power: float = 0.25
) -> torch.Tensor:
    """AWM's log-ratio log π − log π_old = w(ℓ_old) − w(ℓ), (B,) (see :func:`awm_surrogate`). 0 on-policy, where its
    gradient is −∇w: advantage-weighted flow matching."""
    return awm_surrogate(old_error.detach(), sigma, weighting, power) - awm_surrogate(error, sigma, weighting, power)


def dgpo_loss(
    error: torch.Tensor,
    reference_error: torch.Tensor,
    advantages: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    beta: float,
    old_error: torch.Tensor | None = None,
    clip: float = 0.0,
) -> torch.Tensor:
    """DGPO's loss per sample, (B,): ``w_g·A·ℓ_θ`` with the group weight ``w_g = sigmoid(β/|g| · Σ_{i∈g} A_i·δ_i)``,
    ``δ = sg(ℓ_θ − ℓ_ref)`` at noise shared within the group; its gradient is that of the group-level DPO objective
    −log σ(R(G⁺) − R(G⁻)) (with Σ_g A = 0). With ``old_error`` (an old model's ℓ at the same noise) and ``clip`` c > 0
    (DGPO's ``clip_dsm``), ℓ_θ's gradient is stopped where ρ = exp(ℓ_old − ℓ_θ) > 1 + c with A > 0 or ρ < 1 − c with
    A < 0: a sample that already moved past the band trains no further.

    Args:
        error, reference_error: (B,) flow-matching losses of the policy (with gradient) and the reference.
        advantages: (B,) group advantages.
        groups: (B,) group index in [0, num_groups) of each sample; every group of the batch must be complete.
        beta: DGPO's β.
    """
    delta = (error - reference_error).detach()
    count = torch.bincount(groups, minlength=num_groups).clamp_min(1)
    product = advantages.to(delta.dtype) * delta  # float32, or float64 for float64 models
    sums = torch.zeros(num_groups, device=error.device, dtype=product.dtype).index_add_(0, groups, product)
    weight = torch.sigmoid(beta * sums / count)
    if old_error is not None and clip > 0:
        ratio = torch.exp(old_error.detach() - error.detach())
        past = ((ratio > 1 + clip) & (advantages > 0)) | ((ratio < 1 - clip) & (advantages < 0))
        error = torch.where(past, error.detach(), error)
    return weight[groups] * advantages * error


# DiffusionART (ALGORITHMS-NEXT §2.17.4). Confirmed: guidance aggregated per prompt before it is applied,
# G(c) = normalize(Cov(R, x0 | c)), velocity regressed on states the ODE rollout visited toward targets frozen at
# rollout, two disjoint update windows per rollout. How G(c) enters the target and `normalize` are not published; the
# reading here is derived: a tilt p_old·exp(R/β) shifts the posterior mean E[x0 | x_t] by Cov(x0, R | x_t)/β, which at
# high noise is the prompt's Cov(x0, R | c) and vanishes as x_t pins x0 down, scaled here by the posterior variance of
# unit-variance data at σ.
def art_guidance(x0: torch.Tensor, advantages: torch.Tensor, group_size: int, eps: float = 1e-12) -> torch.Tensor:
    """DiffusionART's aggregated guidance, one direction per group of ``group_size`` consecutive rows, (B / G, ...).

    G(c) = normalize(Σ_k (A_k − Ā)·x0_k / G), the group's reward–endpoint covariance (A: any per-group positive affine
    map of the rewards, e.g. the advantages, or pairwise labels 1 / 0 / ½), normalised once after aggregation to unit
    root-mean-square per element; zero where the group's rewards are all equal. With G = 2 it is ±(x0_winner −
    x0_loser)/rms.

    Args:
        x0: (B, ...) the rollouts' clean latents, groups in consecutive rows.
        advantages: (B,) rewards or advantages.
    """
    x0 = x0.float().unflatten(0, (-1, group_size))
    centred = advantages.float().view(-1, group_size)
    centred = centred - centred.mean(dim=1, keepdim=True)
    covariance = (centred.view(*centred.shape, *([1] * (x0.ndim - 2))) * x0).mean(dim=1)
    rms = covariance.pow(2).mean(dim=tuple(range(1, covariance.ndim)), keepdim=True).sqrt()
    return torch.where(rms > eps, covariance / rms.clamp_min(eps), torch.zeros_like(covariance))


def art_tilt_scale(sigma: torch.Tensor) -> torch.Tensor:
    """λ(σ) = σ² / ((1 − σ)² + σ²) in [0, 1]: the posterior variance of x0 given x_σ = (1 − σ)·x0 + σ·ε for unit-variance
    Gaussian data, which scales how far a reward tilt moves E[x0 | x_σ] (1 at pure noise, 0 at σ = 0). (B,) → (B,)."""
    sigma = sigma.float()
    return sigma**2 / ((1 - sigma) ** 2 + sigma**2)


def art_loss(velocity: torch.Tensor, noisy: torch.Tensor, sigma: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """DiffusionART's regression per sample, (B,): ``mean((x_σ − σ·v_θ − x̂0*)²)``, the clean prediction of v_θ at a
    visited state x_σ against the frozen target x̂0* = x̂0_old(x_σ) + η·λ(σ)·G(c). At v_θ = v_old its gradient in v_θ
    is 2σ·η·λ(σ)·G(c)/D (D elements): a descent step moves x̂0 along the guidance, not at all where it is zero
    (tied rewards).

    Args:
        velocity: (B, ...) v_θ at ``noisy`` (with gradient).
        noisy: (B, ...) states the rollout visited.
        sigma: (B,) their noise levels.
        target: (B, ...) the frozen clean-sample targets.
    """
    shape = (-1,) + (1,) * (noisy.ndim - 1)
    error = noisy.float() - sigma.view(shape).float() * velocity.float() - target.float()
    return (error**2).mean(dim=tuple(range(1, error.ndim)))


def dmd_loss(generated: torch.Tensor, real: torch.Tensor, fake: torch.Tensor, floor: float = 1e-6) -> torch.Tensor:
    """DMD2's generator loss per sample, (B,) (ALGORITHMS-NEXT §2.17.1): ``½·mean((x_g − sg(x_g − g))²)`` with
    g = (x̂0_fake − x̂0_real) / mean|x_g − x̂0_real| (per-sample normaliser, floored; non-finite entries zeroed).

    Its gradient in x_g is g/D (D elements): a descent step moves the generated sample toward the teacher's ("real")
    clean prediction and away from the fake score's, both taken at the same re-noised x_σ = (1 − σ)·sg(x_g) + σ·ε; it
    is zero where the two predictions agree (a fake score equal to the teacher).

    Args:
        generated: (B, ...) x_g, the student's clean sample (with gradient).
        real: (B, ...) the teacher's clean prediction at x_σ (no gradient needed; detached here).
        fake: (B, ...) the fake score's clean prediction at x_σ.
    """
    dims = tuple(range(1, generated.ndim))
    generated, real, fake = generated.float(), real.detach().float(), fake.detach().float()
    scale = (generated.detach() - real).abs().mean(dim=dims, keepdim=True).clamp_min(floor)
    gradient = torch.nan_to_num((fake - real) / scale)
    return 0.5 * ((generated - (generated.detach() - gradient)) ** 2).mean(dim=dims)


def gan_discriminator_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """DMD2's classifier loss per sample, (B,): ``softplus(−D(real)) + softplus(D(fake))`` (2·ln 2 at chance; its
    minimum 0 as the logits separate)."""
    return F.softplus(-real_logits) + F.softplus(fake_logits)


def gan_generator_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """DMD2's non-saturating GAN loss of the student's samples, (B,): ``softplus(−D(x_g))``; its gradient in the logit
    is −sigmoid(−D): a descent step raises the classifier's "real" logit of the student's samples."""
    return F.softplus(-fake_logits)


__all__ = [
    "spo_loss",
    "AWM_WEIGHTINGS",
    "ambient_velocity_error",
    "art_guidance",
    "art_loss",
    "art_tilt_scale",
    "awm_log_ratio",
    "awm_surrogate",
    "clipped_fraction",
    "clipped_surrogate",
    "consistency_loss",
    "dgpo_loss",
    "dmd_loss",
    "flow_matching_error",
    "gan_discriminator_loss",
    "gan_generator_loss",
    "gaussian_step_kl",
    "nft_loss",
    "normalized_log_ratio",
    "optimality_probability",
]


# Diffusion-DPO (ALGORITHMS.md §6) with TRL's DPO loss types. A pair's implicit rewards are β times its log-ratios
# r_w = −½(e_θ^w − e_ref^w), r_l = −½(e_θ^l − e_ref^l) (per-sample denoising errors e, the paper's T·ω(λ) folded into
# β), so z = β(r_w − r_l) = −β/2·((e_θ^w − e_θ^l) − (e_ref^w − e_ref^l)), and each loss is TRL's formula in them.
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "bco_pair", "apo_zero", "apo_down", "sft")


def _dpo_loss(kind: str, chosen: torch.Tensor, rejected: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    """Per-pair loss of one type from the log-ratios ``chosen`` = r_w and ``rejected`` = r_l, (B,)."""
    z = beta * (chosen - rejected)
    if kind == "sigmoid":
        return -F.logsigmoid(z)
    if kind == "hinge":
        return torch.relu(1 - z)
    if kind == "ipo":  # (Δ − 1/(2β))², β as IPO's τ
        return (chosen - rejected - 1 / (2 * beta)) ** 2
    if kind == "robust":  # labels flipped with probability ε (Chowdhury et al., 2024)
        return ((1 - smoothing) * -F.logsigmoid(z) + smoothing * F.logsigmoid(-z)) / (1 - 2 * smoothing)
    if kind == "exo_pair":  # KL(softmax(z) ‖ (1 − ε, ε)) over the pair
        eps = torch.tensor(smoothing, dtype=z.dtype, device=z.device)
        return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps)) + torch.sigmoid(-z) * (
            F.logsigmoid(-z) - torch.log(eps)
        )
    if kind == "bco_pair":
        return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)
    if kind == "apo_down":
        return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(z)
    raise ValueError(f"unknown DPO loss type {kind!r}; one of {list(DPO_LOSS_TYPES)}")


def dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    beta: float,
    loss_types: list[str] | tuple[str, ...] = ("sigmoid",),
    loss_weights: list[float] | None = None,
    label_smoothing: float = 0.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Diffusion-DPO per pair from per-sample denoising errors, all (B,) float32.

    ``loss_types`` are TRL's names, summed with ``loss_weights`` (default 1 each); ``sft`` is the plain denoising
    error of the chosen image (no reference needed: ``ref_*`` may be None when it is the only type).
    ``weights`` (B,) in {1, 0.5}: a pair of weight ½ (a tie) is scored in both orders, half each.

    Returns the per-pair losses (B,) and the implicit rewards β·r_w and β·r_l (B,) (zeros without a reference).
    """
    loss_weights = [1.0] * len(loss_types) if loss_weights is None else loss_weights
    if ref_chosen is None:
        ref_chosen, ref_rejected = policy_chosen.detach(), policy_rejected.detach()
    chosen = -0.5 * (policy_chosen - ref_chosen)
    rejected = -0.5 * (policy_rejected - ref_rejected)

    def ordered(first: torch.Tensor, second: torch.Tensor, first_error: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(first)
        for kind, weight in zip(loss_types, loss_weights):
            term = first_error if kind == "sft" else _dpo_loss(kind, first, second, beta, label_smoothing)
            total = total + weight * term
        return total

    losses = ordered(chosen, rejected, policy_chosen)
    if weights is not None:
        losses = weights * losses + (1 - weights) * ordered(rejected, chosen, policy_rejected)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def spo_loss(
    log_ratio_chosen: torch.Tensor, log_ratio_rejected: torch.Tensor, beta: float, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SPO's per-step preference loss, (P,): ``−log σ(β·log ρ_w − β·log ρ_l)`` with each ratio ρ = π_θ/π_ref of the
    step's transition clipped to [1 − ε, 1 + ε] (β 10, ε 0.1 in the paper), which stops the gradient of a pair
    side once its ratio leaves the band.

    Args:
        log_ratio_chosen, log_ratio_rejected: (P,) log π_θ(x_{t−1}|x_t) − log π_ref(x_{t−1}|x_t) of the preferred and
            the other candidate of each pair (the same x_t).

    Returns:
        The losses (P,) and the clipped log-ratios of both sides (P,), (P,).
    """
    low, high = math.log(1 - epsilon), math.log(1 + epsilon)
    chosen, rejected = log_ratio_chosen.clamp(low, high), log_ratio_rejected.clamp(low, high)
    return F.softplus(-beta * (chosen - rejected)), chosen, rejected
