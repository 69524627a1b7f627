"""The one place that imports TRL's private names, so a TRL rename breaks a single import (bounded in pyproject)."""

from trl.trainer.base_config import _BaseConfig
from trl.trainer.base_trainer import _BaseTrainer
from trl.trainer.utils import RepeatSampler, repeat_iterable_dataset

__all__ = ["RepeatSampler", "_BaseConfig", "_BaseTrainer", "repeat_iterable_dataset"]
