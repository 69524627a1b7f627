"""Preference pairs from AI feedback (Diffusion-DPO §5.3): several samples per prompt from a model, ranked by reward
functions; the best and the worst of each prompt become a (prompt, chosen, rejected) row for Diffusion-DPO."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import DiffusionPipeline

from .policies import SamplerSettings, make_policy
from .rewards import RewardFunc, get_reward_function, reward_name, score_images, weighted_reward_sum
from .sampling import RolloutPlan, generate, mix_seed
from .visualization import to_pil


def best_and_worst(scores: torch.Tensor, min_margin: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For scores (P, G) of G samples of each of P prompts: the index of the best (P,) and of the worst (P,) sample,
    and whether the pair is kept (P,) bool: its gap is positive and at least ``min_margin``. Ties go to the first."""
    best, worst = scores.argmax(dim=1), scores.argmin(dim=1)
    gap = scores.gather(1, best[:, None])[:, 0] - scores.gather(1, worst[:, None])[:, 0]
    return best, worst, (gap > 0) & (gap >= min_margin)


def build_preference_pairs(
    model: str | DiffusionPipeline,
    prompts: Sequence[str],
    reward_funcs: str | RewardFunc | Sequence[str | RewardFunc],
    settings: SamplerSettings,
    reward_weights: Sequence[float] | None = None,
    num_images: int = 4,
    seed: int = 0,
    batch_size: int = 8,
    min_margin: float = 0.0,
):
    """A preference dataset (``datasets.Dataset``: ``prompt``, ``chosen``, ``rejected`` PIL images, and the
    ``score_chosen`` / ``score_rejected`` weighted rewards) from ``num_images`` samples of each prompt.

    Samples use the policy's deterministic sampler (``settings`` with ``eta`` 0 gives the pipeline's own ODE
    or DDIM sampler) from initial noise seeded by (``seed``, prompt index, sample index), so a dataset is reproducible
    and does not depend on ``batch_size``. A prompt whose best and worst scores differ by less than ``min_margin``
    gives no row (ties teach DPO nothing).

    Args:
        model: a pipeline or its Hub id / directory (image families; editing and image-to-video need condition
            columns and are not handled here).
        reward_funcs: names, ``module:function`` paths or callables, as ``reward_funcs`` in the trainers' configs.
        num_images: samples per prompt, at least 2.

    Raises:
        ValueError for fewer than 2 images per prompt, a video or image-conditioned model, or mismatched weights.
    """
    from datasets import Dataset

    if num_images < 2:
        raise ValueError(f"num_images must be >= 2 to form a pair, got {num_images}")
    pipeline = DiffusionPipeline.from_pretrained(model) if isinstance(model, str) else model
    policy = make_policy(pipeline, settings)
    if policy.is_video or policy.condition_columns:
        raise ValueError(
            f"{type(pipeline).__name__}: preference pairs are built for text-to-image models (this one generates "
            f"videos or conditions on {list(policy.condition_columns)})"
        )
    funcs = [reward_funcs] if isinstance(reward_funcs, str) or callable(reward_funcs) else list(reward_funcs)
    funcs = [get_reward_function(f) for f in funcs]
    weights = (
        torch.ones(len(funcs)) if reward_weights is None else torch.tensor(list(reward_weights), dtype=torch.float32)
    )
    if weights.numel() != len(funcs):
        raise ValueError(
            f"{len(funcs)} reward functions ({[reward_name(f) for f in funcs]}) but {weights.numel()} weights"
        )

    plan = RolloutPlan.deterministic(policy.num_steps)
    samples = [(p, i) for p in range(len(prompts)) for i in range(num_images)]
    images, scores = [], []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        texts = [prompts[p] for p, _ in chunk]
        generators = [torch.Generator().manual_seed(mix_seed(seed, p, i)) for p, i in chunk]
        cond = policy.encode_prompts(texts)
        batch = generate(policy, policy.denoiser, generators, cond, plan)["images"]
        images.append(batch.cpu())
        scores.append(weighted_reward_sum(score_images(funcs, texts, batch, {}), weights, texts).cpu())
    images, scores = torch.cat(images).view(len(prompts), num_images, *images[0].shape[1:]), torch.cat(scores)
    scores = scores.view(len(prompts), num_images)

    rows = {"prompt": [], "chosen": [], "rejected": [], "score_chosen": [], "score_rejected": []}
    best, worst, keep = best_and_worst(scores, min_margin)
    for p, prompt in enumerate(prompts):
        if not keep[p]:
            continue
        high, low = scores[p, best[p]].item(), scores[p, worst[p]].item()
        chosen, rejected = to_pil(images[p, [best[p], worst[p]]])
        rows["prompt"].append(prompt)
        rows["chosen"].append(chosen)
        rows["rejected"].append(rejected)
        rows["score_chosen"].append(high)
        rows["score_rejected"].append(low)
    return Dataset.from_dict(rows)
