"""What every trainer's config shares, beside TRL's `_BaseConfig`: the model loading keywords and the argument groups
of context parallelism, performance accounting, speed options, evaluation, EMA and frozen components, with their
checks."""

from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import _BaseConfig
from .context_parallel import ContextParallelArguments
from .ema import EMAArguments
from .evaluation import EvaluationArguments
from .frozen_components import FrozenComponentsArguments
from .gradient_surgery import GradientSurgeryArguments
from .media import check_trackers
from .performance import PerformanceArguments
from .preemption import PreemptionArguments
from .speed import SpeedArguments


@dataclass
class DiffusionTrainingConfig(
    ContextParallelArguments,
    PerformanceArguments,
    PreemptionArguments,
    SpeedArguments,
    EvaluationArguments,
    EMAArguments,
    FrozenComponentsArguments,
    GradientSurgeryArguments,
    _BaseConfig,
):
    """The fields and checks of [`~trl_dance.trainer.rollout_config.RolloutConfig`] and
    [`~trl_dance.trainer.dataset_config.DatasetTrainingConfig`] alike (documented in each method's config)."""

    _VALID_DICT_FIELDS = [*_BaseConfig._VALID_DICT_FIELDS, "model_init_kwargs", "audio_to_video_gradient_scales"]

    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments of DiffusionPipeline.from_pretrained."}
    )
    merge_lora: list[str] | None = field(
        default=None,
        metadata={"help": "LoRA folders (diffusers format) fused into the base weights before training."},
    )

    def __post_init__(self):
        super().__post_init__()
        # The training config decides precision. transformers starts from ACCELERATE_MIXED_PRECISION (what `accelerate
        # launch` sets from its config file's mixed_precision) and overrides it only when bf16/fp16 is on, so an
        # accelerate config with bf16 would otherwise win over `bf16: false`.
        self.mixed_precision = "fp16" if self.fp16 else "bf16" if self.bf16 else "no"
        if self.use_cpu or not torch.accelerator.is_available():  # no device to pin for: torch warns at every loader
            self.dataloader_pin_memory = False
        check_trackers(self.report_to)
        self._check_frozen_components()
        self._check_context_parallel()
        self._check_speed()
        self._check_preemption()
        self._check_ema()
        self._check_evaluation()
        self._check_gradient_surgery()
