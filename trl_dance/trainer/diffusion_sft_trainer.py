"""Supervised fine-tuning of diffusion and flow models on (prompt, image or video) rows: the family's own training
loss on noised real data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from transformers import TrainerCallback

from ..sft_data import SFTCollator
from .dataset_trainer import DatasetTrainer
from .diffusion_sft_config import DiffusionSFTConfig


class DiffusionSFTTrainer(DatasetTrainer):
    """Supervised fine-tuning (TRL's ``SFTTrainer`` for diffusion models): per row a time from the config's density,
    a noise, the noisy latent of the family's forward process and the mean squared error of the denoiser's prediction
    against its training target (velocity for flow models; ε or v for SD1.x/SD2/SDXL).

    The constructor's order is ``trl.SFTTrainer``'s (``model``, ``args``, ``data_collator``, ``train_dataset``, ...).

    Args:
        model: a Hub id or local folder of a diffusers pipeline, or a pipeline instance.
        args: the configuration.
        data_collator: rows → batch (default: :class:`~trl_dance.sft_data.SFTCollator`, whose output keys a custom
            one must produce).
        train_dataset: rows with a caption (``dataset_text_field``) and an image or video (``dataset_image_field``):
            paths, bytes, PIL images or arrays; a ``Dataset`` or a streaming ``IterableDataset`` (then ``max_steps``
            sets the length). Decoded and transformed per batch.
        eval_dataset: held-out rows, scored by :meth:`evaluate` at ``eval_steps`` (``eval_loss``, fixed draws).
        callbacks, optimizers: as in ``transformers.Trainer``.
        peft_config: a ``peft.LoraConfig`` to train a LoRA (saved in the diffusers format); ``None`` fine-tunes the
            whole denoiser.
    """

    _tag_names = ["trl", "trl-dance", "sft", "diffusers"]
    _name = "SFT"
    _paper = {}

    def __init__(
        self,
        model: str | DiffusionPipeline,
        args: DiffusionSFTConfig | None = None,
        data_collator: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        peft_config: LoraConfig | None = None,
    ):
        args = self._resolve_args(model, args, DiffusionSFTConfig, "SFT")
        self._image_field = args.dataset_image_field
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, callbacks, optimizers, peft_config)
        self.density = args.time_density()

    def _prepare_dataset(self, dataset, args: DiffusionSFTConfig, name: str, policy) -> Dataset | IterableDataset:
        """``dataset`` with its caption and image (or video) columns checked."""
        if not isinstance(dataset, (Dataset, IterableDataset)):
            raise TypeError(f"{name} must be a datasets.Dataset or IterableDataset, got {type(dataset).__name__}")
        columns = dataset.column_names
        if columns is None:  # a stream whose features are not declared: read them off its first row
            columns = list(next(iter(dataset)))
        if self._image_field is None:
            self._image_field = "video" if policy.is_video and "video" in columns else "image"
        missing = [c for c in (args.dataset_text_field, self._image_field) if c not in columns]
        if missing:
            raise ValueError(
                f"{name} has no column {missing} (columns: {columns}); set dataset_text_field / dataset_image_field"
            )
        if not isinstance(dataset, IterableDataset) and len(dataset) == 0:
            raise ValueError(f"{name} has no rows")
        return dataset

    def _collator(self, args, seed: int, training: bool) -> SFTCollator:
        fields = {"text_field": args.dataset_text_field, "image_field": self._image_field}
        if not training:  # evaluation: centre crops, no flips, no caption dropout
            return SFTCollator(args.resolution, False, False, num_frames=self._clip_frames, **fields)
        return SFTCollator(
            args.resolution, args.random_crop, args.random_flip, args.proportion_empty_prompts, seed=seed,
            num_frames=self._clip_frames, **fields,
        )  # fmt: skip

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = [self.args.dataset_text_field, self._image_field]

    def _errors(self, model, inputs: dict[str, Any], generators: list[torch.Generator] | None = None):
        """Per-sample denoising errors (B,) float32 and the prediction; noise and time from the training generator,
        or row ``b``'s from the CPU generator ``generators[b]`` (evaluation: independent of batching)."""
        latents, cond = self._encode_batch(inputs, generators)
        policy, shape = self.policy, (1, *latents.shape[1:])
        if generators is None:
            noise = torch.randn(latents.shape, generator=self._noise_generator, device=latents.device)
            time = policy.process.sample_training_times(
                len(latents), self._noise_generator, latents.device, self.density
            )
        else:
            draws = [(torch.randn(shape, generator=g), policy.process.sample_training_times(1, g, "cpu", self.density))
                     for g in generators]  # fmt: skip
            noise, time = (torch.cat(part).to(latents.device) for part in zip(*draws))
        noisy = policy.process.add_noise(latents, noise, time)
        target = policy.process.training_target(latents, noise, time)
        prediction = policy.predict(model, noisy, cond, at=time)
        return ((prediction - target.float()) ** 2).mean(dim=tuple(range(1, latents.ndim))), prediction

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        errors, prediction = self._errors(model, inputs)
        if model.training:
            self.performance.add_samples(len(inputs["prompts"]) / self.args.context_parallel_size)
        self._record("mse", errors)
        self._record("data/missing_images", torch.tensor([float(inputs["num_missing"])], device=errors.device))
        self._count_missing_images(inputs["missing"])
        loss = errors.mean()
        return (loss, prediction) if return_outputs else loss

    def _evaluation_losses(self, batch: dict[str, Any], generators: list[torch.Generator]) -> dict[str, torch.Tensor]:
        return {"loss": self._errors(self.model, batch, generators)[0]}

    def _model_card_details(self) -> dict[str, str]:
        args = self.args
        return {
            "SFT": f"denoising loss, {args.weighting_scheme} time density, {args.resolution} px, caption dropout "
            f"{args.proportion_empty_prompts}"
        }


__all__ = ["DiffusionSFTTrainer"]
