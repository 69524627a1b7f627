from .dance_grpo_config import DanceGRPOConfig
from .dance_grpo_trainer import DanceGRPOTrainer
from .diffusion_dpo_config import DiffusionDPOConfig
from .diffusion_dpo_trainer import DiffusionDPOTrainer

__all__ = ["DanceGRPOConfig", "DanceGRPOTrainer", "DiffusionDPOConfig", "DiffusionDPOTrainer"]
