"""Reward functions: ``f(prompts: list[str], images: Tensor (B, 3, H, W) in [0, 1], **columns) -> list[float]``."""

from .base import RewardFunc, get_reward_function, reward_name, score_images
from .pixel import brightness, jpeg_compressibility, jpeg_incompressibility

__all__ = [
    "RewardFunc",
    "brightness",
    "get_reward_function",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "reward_name",
    "score_images",
]
