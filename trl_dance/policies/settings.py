"""How a policy samples: the settings a rollout trainer's config gives it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..sde import Reduction


@dataclass
class SamplerSettings:
    """How a policy samples. See :class:`~trl_dance.DanceGRPOConfig` for the meaning of each field."""

    num_inference_steps: int = 16
    height: int = 720
    width: int = 720
    guidance_scale: float = 3.5
    eta: float = 0.3
    sde_type: Literal["dance", "flow_grpo", "cps", "flash"] = "dance"
    sigma_schedule: Literal["dance", "pipeline"] = "dance"
    shift: float = 3.0
    max_sequence_length: int = 512
    log_prob_reduction: Reduction = "mean"
    num_frames: int | None = None
    negative_prompt: str | None = None
    guidance_scale_2: float | None = None
    train_expert: Literal["high_noise", "low_noise"] = "high_noise"
    pipeline_kwargs: dict | None = None

    @classmethod
    def from_config(cls, args) -> SamplerSettings:
        """The settings of a rollout trainer's config: its fields of the same names, and the SDE's where the method
        samples with one (``args.sde_settings()``)."""
        names = [name for name in cls.__dataclass_fields__ if name not in ("eta", "sde_type", "log_prob_reduction")]
        return cls(**{name: getattr(args, name) for name in names}, **args.sde_settings())


__all__ = ["SamplerSettings"]
