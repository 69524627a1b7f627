"""Configuration of :class:`~trl_dance.DiffusionSFTTrainer`."""

from dataclasses import dataclass, field

from .dataset_config import DatasetTrainingConfig


@dataclass
class DiffusionSFTConfig(DatasetTrainingConfig):
    r"""
    Configuration for [`DiffusionSFTTrainer`]: supervised fine-tuning of a diffusion or flow model on (prompt, image)
    or (prompt, video) rows, with the loss its family was trained with: per sample a time ``t`` from
    `weighting_scheme`'s density and a Gaussian noise ``ε``, the noisy latent ``x_t`` of the forward process, and the
    mean squared error of the denoiser's prediction against its training target (the velocity ``ε − x0`` for
    flow-matching models, ε or v for SD1.x/SD2/SDXL), averaged over latent dimensions and samples.

    Parameters:
        dataset_text_field (`str`, defaults to `"prompt"`): The caption column (TRL's name; Pick-a-Pic-style
            `"caption"` works too).
        dataset_image_field (`str` or `None`, defaults to `None`): The image or video column: paths, bytes, PIL images
            or arrays, videos as frame lists or files; `None`: `"image"`, or `"video"` for a video model.
        resolution, num_frames, random_crop, random_flip, proportion_empty_prompts, max_missing_images,
        weighting_scheme, logit_mean, logit_std, mode_scale, guidance_scale, max_sequence_length, model_init_kwargs,
        memory, EMA, context-parallel, speed and evaluation fields: as in [`DiffusionDPOConfig`] (one image per row
        instead of a pair). SD3's and FLUX's published fine-tuning scripts use `weighting_scheme="logit_normal"`.
    """

    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate (LoRA; full: ~1e-5)."})
    dataset_text_field: str = field(default="prompt", metadata={"help": "The caption column."})
    dataset_image_field: str | None = field(
        default=None, metadata={"help": "The image or video column (default: image, or video for video models)."}
    )
