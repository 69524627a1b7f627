"""The reward-function protocol, lookup by name or import path, and validated scoring."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

RewardFunc = Callable[..., Sequence[float]]
"""``f(prompts: list[str], images: Tensor (B, 3, H, W) float in [0, 1], **columns) -> B floats``."""


def _registry() -> dict[str, Callable[..., Any]]:
    """Registered names: pixel rewards are plain functions; model rewards are classes built with ``kwargs``."""
    from . import aesthetic, clip, hps, image_reward, pixel

    return {
        "brightness": pixel.brightness,
        "jpeg_compressibility": pixel.jpeg_compressibility,
        "jpeg_incompressibility": pixel.jpeg_incompressibility,
        "hpsv2": hps.HPSv2Reward,
        "image_reward": image_reward.ImageReward,
        "pickscore": clip.PickScore,
        "clip_score": clip.CLIPScore,
        "aesthetic": aesthetic.AestheticReward,
    }


def get_reward_function(spec: str | RewardFunc, **kwargs: Any) -> RewardFunc:
    """Resolve a reward: a callable (returned as is), a registered name (``"hpsv2"``), or ``"module.path:func"``.

    Args:
        kwargs: constructor arguments of a registered model reward (checkpoint paths, dtype, batch size), e.g.
            ``get_reward_function("hpsv2", checkpoint="/ckpt/HPS_v2.1_compressed.pt")``.
    """
    if callable(spec):
        if kwargs:
            raise ValueError(f"reward arguments {sorted(kwargs)} given for an already built reward {spec!r}")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a reward must be a callable, a registered name or 'module:function', got {type(spec)}")
    registry = _registry()
    if spec in registry:
        entry = registry[spec]
        if isinstance(entry, type):
            return entry(**kwargs)
        if kwargs:
            raise ValueError(f"reward {spec!r} takes no arguments, got {sorted(kwargs)}")
        return entry
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        func = getattr(importlib.import_module(module_name), attr, None)
        if not callable(func):
            raise ValueError(f"reward {spec!r}: {module_name} has no callable {attr!r}")
        return func(**kwargs) if isinstance(func, type) else func
    raise ValueError(
        f"unknown reward {spec!r}; registered rewards: {sorted(registry)}, or pass 'module.path:function'"
    )


def registered_rewards() -> list[str]:
    """Names accepted by :func:`get_reward_function` and in ``reward_funcs`` of a config."""
    return sorted(_registry())


def reward_name(func: RewardFunc) -> str:
    """The name a reward is logged under: ``rewards/<name>/mean``."""
    return getattr(func, "__name__", None) or type(func).__name__


def score_images(
    funcs: Sequence[RewardFunc], prompts: list[str], images: torch.Tensor, columns: dict[str, list[Any]]
) -> torch.Tensor:
    """Call every reward function on one batch and validate what it returns.

    Returns:
        (B, F) float32 on ``images.device``, one column per function.

    Raises:
        ValueError naming the function if it returns the wrong number of values, non-numbers, or NaN/inf.
    """
    batch = images.shape[0]
    columns_out = []
    for func in funcs:
        name = reward_name(func)
        values = func(prompts=prompts, images=images, **columns)
        if isinstance(values, torch.Tensor):
            values = values.detach().flatten().tolist()
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as err:
            raise ValueError(f"reward function {name!r} must return {batch} numbers, got {values!r:.200}") from err
        if len(values) != batch:
            raise ValueError(f"reward function {name!r} returned {len(values)} values for {batch} images")
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"reward function {name!r} returned non-finite values at positions {bad[:10]}")
        columns_out.append(torch.tensor(values, dtype=torch.float32))
    return torch.stack(columns_out, dim=1).to(images.device)
