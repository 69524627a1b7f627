from .dance_grpo_config import DanceGRPOConfig
from .dance_grpo_trainer import DanceGRPOTrainer

__all__ = ["DanceGRPOConfig", "DanceGRPOTrainer"]
