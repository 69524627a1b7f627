"""The one place that imports private names, so a rename breaks a single import: TRL's (bounded in pyproject) and
torch's module substitution (``torch.func.functional_call``'s, as a context that can outlast one call)."""

from torch.nn.utils.stateless import _reparametrize_module
from trl.trainer.base_config import _BaseConfig
from trl.trainer.base_trainer import _BaseTrainer
from trl.trainer.utils import RepeatSampler, repeat_iterable_dataset

__all__ = ["RepeatSampler", "_BaseConfig", "_BaseTrainer", "_reparametrize_module", "repeat_iterable_dataset"]
