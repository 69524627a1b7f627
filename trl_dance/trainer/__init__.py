from .dance_grpo_config import DanceGRPOConfig
from .dance_grpo_trainer import DanceGRPOTrainer
from .diffusion_dpo_config import DiffusionDPOConfig
from .diffusion_dpo_trainer import DiffusionDPOTrainer
from .diffusion_nft_config import DiffusionNFTConfig
from .diffusion_nft_trainer import DiffusionNFTTrainer
from .direct_reward_config import DirectRewardConfig
from .direct_reward_trainer import DirectRewardTrainer
from .online_dpo_config import OnlineDiffusionDPOConfig
from .online_dpo_trainer import OnlineDiffusionDPOTrainer
from .spo_config import SPOConfig
from .spo_trainer import SPOTrainer

__all__ = [
    "DanceGRPOConfig",
    "DanceGRPOTrainer",
    "DiffusionDPOConfig",
    "DiffusionDPOTrainer",
    "DiffusionNFTConfig",
    "DiffusionNFTTrainer",
    "DirectRewardConfig",
    "DirectRewardTrainer",
    "OnlineDiffusionDPOConfig",
    "OnlineDiffusionDPOTrainer",
    "SPOConfig",
    "SPOTrainer",
]
