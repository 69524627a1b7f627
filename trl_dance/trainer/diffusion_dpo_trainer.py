"""Diffusion-DPO: preference optimization of diffusion and flow models against a frozen reference."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from transformers import TrainerCallback

from ..preference_data import PreferenceCollator, check_labels, drop_ties, preference_format
from .dataset_trainer import DatasetTrainer
from .diffusion_dpo_config import DiffusionDPOConfig
from .pair_denoising import PairDenoising, reward_metrics

logger = logging.getLogger(__name__)


class DiffusionDPOTrainer(DatasetTrainer):
    """Diffusion-DPO (arXiv:2311.12908) for SD1.x/SDXL (ε target) and SD3/FLUX (velocity target), on TRL's base.

    The constructor's order is ``trl.DPOTrainer``'s.

    Args:
        model: a Hub id or local folder of a diffusers pipeline, or a pipeline instance.
        ref_model: the reference: a pipeline (instance, Hub id or folder) or a denoiser of the same class as the
            trained one. ``None``: the model with its LoRA disabled (no copy), or, without LoRA, a frozen copy.
        args: the configuration.
        data_collator: rows → batch (default: :class:`~trl_dance.preference_data.PreferenceCollator`, whose output
            keys a custom one must produce).
        train_dataset: rows in TRL's preference format (``prompt``, ``chosen``, ``rejected`` images) or Pick-a-Pic's
            (``caption``, ``jpg_0``, ``jpg_1``, ``label_0``), a ``Dataset`` or a streaming ``IterableDataset`` (then
            ``max_steps`` sets the length; ties are dropped as they stream). Images are decoded and transformed per
            batch.
        eval_dataset: held-out pairs in either format (a stream is read once), scored by :meth:`evaluate` at
            ``eval_steps``; every image must be present.
        callbacks, optimizers: as in ``transformers.Trainer``.
        peft_config: a ``peft.LoraConfig`` to train a LoRA (saved in the diffusers format); ``None`` fine-tunes the
            whole denoiser.
    """

    _tag_names = ["trl", "trl-dance", "diffusion-dpo", "diffusers"]
    _name = "Diffusion-DPO"
    _row = "pair"
    _paper = {
        "title": "Diffusion Model Alignment Using Direct Preference Optimization",
        "id": "2311.12908",
        "citation": "@inproceedings{wallace2024diffusion,\n  title={Diffusion Model Alignment Using Direct Preference "
        "Optimization},\n  author={Wallace, Bram and others},\n  booktitle={CVPR},\n  year={2024}\n}",
    }

    def __init__(
        self,
        model: str | DiffusionPipeline,
        ref_model: str | DiffusionPipeline | torch.nn.Module | None = None,
        args: DiffusionDPOConfig | None = None,
        data_collator: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        peft_config: LoraConfig | None = None,
    ):
        args = self._resolve_args(model, args, DiffusionDPOConfig, "DiffusionDPO")
        self.needs_reference = args.needs_reference
        self.num_ties_dropped, self.data_format = None, None  # of the train_dataset, set as it is prepared
        super().__init__(
            model, args, data_collator, train_dataset, eval_dataset, callbacks, optimizers, peft_config,
            need_reference=self.needs_reference, ref_model=ref_model,
        )  # fmt: skip
        self.pairs = PairDenoising(self.policy, args)

    def _prepare_dataset(self, dataset, args: DiffusionDPOConfig, name: str, policy) -> Dataset | IterableDataset:
        """``dataset`` checked (labels) with ties dropped when ``args.ties == "drop"``; for the train_dataset, the
        number dropped (``None`` for a stream, which drops them as it streams) and its format (``"preference"`` or
        ``"pickapic"``) kept in ``num_ties_dropped`` and ``data_format``."""
        if not isinstance(dataset, (Dataset, IterableDataset)):
            raise TypeError(f"{name} must be a datasets.Dataset or IterableDataset, got {type(dataset).__name__}")
        streaming = isinstance(dataset, IterableDataset)
        columns = dataset.column_names
        if columns is None:  # a stream whose features are not declared: read them off its first row
            columns = list(next(iter(dataset)))
        try:
            data_format = preference_format(columns)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from err
        ties = 0
        if data_format == "pickapic" and not streaming:
            check_labels(dataset)
        if data_format == "pickapic" and args.ties == "drop":
            dataset, ties = drop_ties(dataset)
            if not streaming:
                logger.warning(f"Diffusion-DPO: dropped {ties} ties from {name}; {len(dataset)} pairs remain")
        if not streaming and len(dataset) == 0:
            hint = f" ({ties} ties were dropped; ties='keep' trains on them)" if ties else ""
            raise ValueError(f"{name} has no preference pairs{hint}")
        if name == "train_dataset":
            self.num_ties_dropped, self.data_format = ties, data_format
        return dataset

    def _collator(self, args, seed: int, training: bool) -> PreferenceCollator:
        if not training:  # evaluation: centre crops, no flips, no caption dropout
            return PreferenceCollator(
                args.resolution, random_crop=False, random_flip=False, num_frames=self._clip_frames
            )
        return PreferenceCollator(
            args.resolution, args.random_crop, args.random_flip, args.proportion_empty_prompts, seed=seed,
            num_frames=self._clip_frames,
        )  # fmt: skip

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "chosen", "rejected", "caption", "jpg_0", "jpg_1", "label_0"]

    def _pair_errors(self, model, inputs: dict[str, Any], generators: list[torch.Generator] | None = None):
        """Per-sample denoising errors (2B,) float32 of the policy and of the reference (None without one), and the
        policy's prediction, for a collated batch. Noise and times come from the training generator, or pair ``b``'s
        latents, noise and time from the CPU generator ``generators[b]`` (evaluation: independent of batching)."""
        # (2B, ...): w0, l0, w1, l1, ...; the VAE's posterior sample too is drawn from the pair's generator
        latents, cond = self._encode_batch(inputs, generators, repeat=2)
        if generators is None:
            draws = self.pairs.draw(latents[::2].shape, self._noise_generator, latents.device)
        else:
            draws = self.pairs.draw_per_pair(latents[::2].shape, generators, latents.device)
        return self.pairs.errors(self, model, latents, cond, draws)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        errors, ref_errors, prediction = self._pair_errors(model, inputs)
        if model.training:
            self.performance.add_samples(len(inputs["prompts"]) / self.args.context_parallel_size)
        self._record("mse/chosen/policy", errors[0::2])
        self._record("mse/rejected/policy", errors[1::2])
        self._record("data/missing_images", torch.tensor([float(inputs["num_missing"])], device=errors.device))
        self._count_missing_images(inputs["missing"])
        losses, chosen, rejected, correct = self.pairs.losses(errors, ref_errors, inputs["weights"])
        if ref_errors is not None:
            self._record("mse/chosen/ref", ref_errors[0::2])
            self._record("mse/rejected/ref", ref_errors[1::2])
            for name, values in reward_metrics(chosen, rejected, correct).items():
                self._record(name, values)
        loss = losses.mean()
        return (loss, prediction) if return_outputs else loss

    def _evaluation_losses(self, batch: dict[str, Any], generators: list[torch.Generator]) -> dict[str, torch.Tensor]:
        """Per pair: the loss and, with a reference, TRL's reward metrics (``rewards/chosen|rejected|accuracies|
        margins``) and ``implicit_acc``, ``margin``."""
        errors, ref_errors, _ = self._pair_errors(self.model, batch, generators)
        losses, chosen, rejected, correct = self.pairs.losses(errors, ref_errors, batch["weights"])
        return {"loss": losses, **(reward_metrics(chosen, rejected, correct) if self.needs_reference else {})}

    def _model_card_details(self) -> dict[str, str]:
        args = self.args
        weights = args.loss_weights or [1.0] * len(args.loss_type)
        losses = " + ".join(f"{w:g}·{kind}" if w != 1 else kind for kind, w in zip(args.loss_type, weights))
        return {
            "Diffusion-DPO": f"{losses} loss, β {args.beta:g}, {args.resolution} px, ties {args.ties}, caption "
            f"dropout {args.proportion_empty_prompts}"
        }

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.num_ties_dropped:
            logs["data/ties_dropped"] = self.num_ties_dropped
        super().log(logs, start_time)


__all__ = ["DiffusionDPOTrainer"]
