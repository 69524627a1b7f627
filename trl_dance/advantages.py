"""Group-relative advantages (ALGORITHMS.md §4). Pure tensor math on the gathered, global batch of rewards."""

from __future__ import annotations

from typing import Literal

import torch

ScaleRewards = Literal["group", "batch", "none"]

# Defaults of the references: DanceGRPO divides by the group std + 1e-8, Flow-GRPO by the batch std + 1e-4.
DEFAULT_EPSILON = {"group": 1e-8, "batch": 1e-4, "none": 0.0}


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: ScaleRewards = "group",
    epsilon: float | None = None,
    clip: float | None = 5.0,
) -> torch.Tensor:
    """``A_i = (r_i − mean_group(r)) / (std + ε)``, clipped to ``±clip``.

    Args:
        rewards: (B,) rewards of the whole (all-process) generation batch, groups contiguous: samples
            ``[k·G, (k+1)·G)`` share a prompt.
        num_generations: group size G (>= 2); must divide B.
        scale_rewards: std of the group (unbiased, DanceGRPO), of the whole batch (Flow-GRPO), or no scaling.
        epsilon: added to the std; defaults to 1e-8 (group), 1e-4 (batch).
        clip: advantages are clipped to ``[−clip, clip]``; None disables.

    Returns:
        (B,) float32 advantages. A group of equal rewards gets zero advantages (never NaN).
    """
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 for group statistics, got {num_generations}")
    if rewards.ndim != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must have shape (k * {num_generations},), got {tuple(rewards.shape)}")
    if scale_rewards not in DEFAULT_EPSILON:
        raise ValueError(f"scale_rewards must be one of {sorted(DEFAULT_EPSILON)}, got {scale_rewards!r}")
    eps = DEFAULT_EPSILON[scale_rewards] if epsilon is None else epsilon
    grouped = rewards.to(torch.float32).view(-1, num_generations)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        advantages = centered / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        advantages = centered / (grouped.std() + eps)
    else:
        advantages = centered
    advantages = advantages.flatten()
    return advantages.clamp(-clip, clip) if clip is not None else advantages
