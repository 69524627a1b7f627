"""The configuration shared by the trainers that learn from datasets of real images or videos (Diffusion-DPO, SFT)."""

from dataclasses import dataclass, field

from .diffusion_config import DiffusionTrainingConfig
from .pair_denoising import TimeDensityArguments


@dataclass
class DatasetTrainingConfig(TimeDensityArguments, DiffusionTrainingConfig):
    """The data, model and evaluation fields of [`DiffusionDPOConfig`] and [`DiffusionSFTConfig`] (documented in
    [`DiffusionDPOConfig`]): images resized and cropped to `resolution` (videos cut to `num_frames`), noised at times
    drawn with `weighting_scheme`'s density."""

    learning_rate: float = field(default=1e-5, metadata={"help": "AdamW learning rate (paper, full: 1e-8 × batch)."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X optimizer updates."})
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of activation_checkpointing (diffusers' enable_gradient_checkpointing)."},
    )
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the image columns."})

    resolution: int = field(default=512, metadata={"help": "Training resolution in pixels."})
    num_frames: int | None = field(default=None, metadata={"help": "Video models: frames per training clip."})
    random_crop: bool = field(default=False, metadata={"help": "Random crop (the same box for a pair's images)."})
    random_flip: bool = field(default=True, metadata={"help": "Random horizontal flip (a pair's images together)."})
    proportion_empty_prompts: float = field(default=0.0, metadata={"help": "Caption dropout probability."})
    max_missing_images: int | None = field(
        default=100,
        metadata={"help": "Skipped rows with a missing or undecodable image (per process) before training stops."},
    )
    guidance_scale: float = field(default=3.5, metadata={"help": "FLUX guidance embedding during training."})
    max_sequence_length: int = field(default=512, metadata={"help": "T5 prompt tokens."})
    eval_prompts: list[str] | None = field(
        default=None, metadata={"help": "Prompts sampled at every evaluation (images to the trackers)."}
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_time_density()
        if not 0 <= self.proportion_empty_prompts <= 1:
            raise ValueError(f"proportion_empty_prompts must be in [0, 1], got {self.proportion_empty_prompts}")
        if self.num_frames is not None and self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1 or None, got {self.num_frames}")
        if self.resolution < 8:
            raise ValueError(f"resolution must be >= 8, got {self.resolution}")
