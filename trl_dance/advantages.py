"""Advantages from rewards (ALGORITHMS.md §4-5): group-relative (GRPO) and per-prompt running statistics (DDPO).

Both act on the gathered, all-process batch of rewards, so every process computes the same values.
"""

from __future__ import annotations

from collections import deque
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
        scale_rewards: std of the group (unbiased, DanceGRPO), of the whole batch (population std: Flow-GRPO's and
            DiffusionNFT's ``global_std``), or no scaling.
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
    elif scale_rewards == "batch":  # the population std, as Flow-GRPO's and DiffusionNFT's np.std
        advantages = centered / (grouped.std(correction=0) + eps)
    else:
        advantages = centered
    advantages = advantages.flatten()
    return advantages.clamp(-clip, clip) if clip is not None else advantages


class PerPromptStatTracker:
    """DDPO's per-prompt statistics: ``A = (r − mean_p) / (std_p + ε)`` over the last ``buffer_size`` rewards of
    prompt ``p``, or over the current batch while the prompt has fewer than ``min_count`` rewards.

    Stds are population stds (ddof 0), ε = 1e-6, as in ddpo-pytorch. The state is a dict of per-prompt buffers,
    saved with :meth:`state_dict` in checkpoints.
    """

    def __init__(self, buffer_size: int = 16, min_count: int = 16, epsilon: float = 1e-6):
        if buffer_size < 1 or min_count < 1:
            raise ValueError("buffer_size and min_count must be >= 1")
        self.buffer_size, self.min_count, self.epsilon = buffer_size, min_count, epsilon
        self.buffers: dict[str, deque[float]] = {}

    def __call__(self, prompts: list[str], rewards: torch.Tensor, clip: float | None = 5.0) -> torch.Tensor:
        """(B,) advantages for B (prompt, reward) pairs, after adding the rewards to the buffers."""
        if len(prompts) != rewards.numel():
            raise ValueError(f"{len(prompts)} prompts for {rewards.numel()} rewards")
        rewards = rewards.to(torch.float32).flatten()
        advantages = torch.empty_like(rewards)
        for prompt in dict.fromkeys(prompts):
            mask = torch.tensor([p == prompt for p in prompts], device=rewards.device)
            buffer = self.buffers.setdefault(prompt, deque(maxlen=self.buffer_size))
            buffer.extend(rewards[mask].tolist())
            if len(buffer) < self.min_count:
                mean, std = rewards.mean(), rewards.std(correction=0)
            else:
                history = torch.tensor(list(buffer), dtype=torch.float32, device=rewards.device)
                mean, std = history.mean(), history.std(correction=0)
            advantages[mask] = (rewards[mask] - mean) / (std + self.epsilon)
        return advantages.clamp(-clip, clip) if clip is not None else advantages

    def state_dict(self) -> dict:
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "buffers": {p: list(b) for p, b in self.buffers.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.buffer_size, self.min_count = state["buffer_size"], state["min_count"]
        self.buffers = {p: deque(values, maxlen=self.buffer_size) for p, values in state["buffers"].items()}


def nan_std(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The sample standard deviation (Bessel-corrected) over the non-NaN entries; NaN where fewer than two."""
    count = (~values.isnan()).sum(dim=dim, keepdim=True) if dim is not None else (~values.isnan()).sum()
    mean = values.nanmean(dim=dim, keepdim=True) if dim is not None else values.nanmean()
    squares = (
        ((values - mean) ** 2).nansum(dim=dim, keepdim=True) if dim is not None else ((values - mean) ** 2).nansum()
    )
    std = (squares / (count - 1).clamp(min=1)).sqrt().masked_fill(count < 2, float("nan"))
    return std if keepdim or dim is None else std.squeeze(dim)


def normalized_reward_sum(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    clip: float | None = 5.0,
    epsilon: float = 1e-4,
    renormalize: bool = True,
) -> torch.Tensor:
    """GDPO / TRL's ``normalize_then_sum``: each reward normalised in its group, weighted and summed, then normalised
    over the batch; with ``renormalize=False`` the weighted sum itself (MixGRPO's ``advantage_aggr``, DanceGRPO's
    video VQ + MQ advantages).

    Args:
        rewards: (B, F) rewards of the F reward functions, groups contiguous (``[k·G, (k+1)·G)``); NaN where a
            reward abstained.
        weights: (F,) weights of the sum.
        num_generations: group size G (>= 2); must divide B.
        clip: advantages are clipped to ``±clip``; None disables.
        epsilon: added to each std (TRL's 1e-4).

    Returns:
        (B,) float32 advantages.
    """
    if rewards.ndim != 2 or rewards.shape[0] % num_generations or num_generations < 2:
        raise ValueError(f"rewards must be (k · {num_generations}, F) with G >= 2, got {tuple(rewards.shape)}")
    grouped = rewards.to(torch.float32).view(-1, num_generations, rewards.shape[1])
    # A reward's abstentions (NaN) are left out of its group statistics and of the sum, as in TRL.
    normalized = (grouped - grouped.nanmean(dim=1, keepdim=True)) / (nan_std(grouped, dim=1, keepdim=True) + epsilon)
    total = (normalized.view(-1, rewards.shape[1]) * weights.to(normalized)).nansum(dim=1)
    advantages = (total - total.mean()) / (total.std() + epsilon) if renormalize else total
    return advantages.clamp(-clip, clip) if clip is not None else advantages


def extremes_per_group(advantages: torch.Tensor, num_generations: int, k: int) -> torch.Tensor:
    """Best-of-N: indices (2k · groups,) of the k highest and k lowest advantages of each group, sorted.

    Args:
        advantages: (B,) advantages, groups contiguous.
        num_generations: G; must divide B; ``2k <= G``.
    """
    if advantages.numel() % num_generations or not 1 <= 2 * k <= num_generations:
        raise ValueError(f"need B % G == 0 and 1 <= 2k <= G, got B={advantages.numel()}, G={num_generations}, k={k}")
    order = advantages.view(-1, num_generations).argsort(dim=1, stable=True)
    chosen = torch.cat([order[:, :k], order[:, -k:]], dim=1)
    offsets = torch.arange(chosen.shape[0], device=chosen.device)[:, None] * num_generations
    return (chosen + offsets).flatten().sort().values
