"""Reward functions: ``f(prompts: list[str], images: Tensor (B, 3, H, W) in [0, 1], **columns) -> list[float]``
(videos: see :func:`score_images`)."""

from .aesthetic import AestheticReward
from .audio import CLAPScore, av_sync
from .base import (
    RewardError,
    RewardFunc,
    check_reward_signature,
    get_reward_function,
    registered_rewards,
    resolve_reward_funcs,
    reward_name,
    score_images,
    weighted_reward_sum,
)
from .clip import CLIPScore, PickScore
from .hps import HPSv2Reward
from .hpsv3 import HPSv3Reward
from .image_reward import ImageReward
from .judges import PairwiseJudge, PointwiseJudge
from .llava_bertscore import LLaVABertScoreLocal
from .model_reward import RewardModel
from .ocr import EasyOCRJudge, OCRReward
from .pixel import brightness, jpeg_compressibility, jpeg_incompressibility, temporal_consistency
from .remote import RemoteReward, RemoteRewardError
from .video_align import VideoAlignReward

__all__ = [
    "AestheticReward",
    "CLAPScore",
    "CLIPScore",
    "EasyOCRJudge",
    "HPSv2Reward",
    "HPSv3Reward",
    "ImageReward",
    "LLaVABertScoreLocal",
    "OCRReward",
    "PairwiseJudge",
    "PickScore",
    "PointwiseJudge",
    "RemoteReward",
    "RemoteRewardError",
    "RewardError",
    "RewardFunc",
    "RewardModel",
    "VideoAlignReward",
    "av_sync",
    "brightness",
    "check_reward_signature",
    "get_reward_function",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "registered_rewards",
    "resolve_reward_funcs",
    "reward_name",
    "score_images",
    "temporal_consistency",
    "weighted_reward_sum",
]
