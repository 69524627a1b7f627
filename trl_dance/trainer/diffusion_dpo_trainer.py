"""Diffusion-DPO: preference optimization of diffusion and flow models against a frozen reference."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from transformers import TrainerCallback

from ..policies import SamplerSettings, make_policy
from ..preference_data import (
    INDEX_KEY,
    IndexedRows,
    PreferenceCollator,
    check_labels,
    drop_ties,
    preference_format,
)
from ..sampling import mix_seed
from .context_parallel import STREAMING_WITH_CONTEXT_PARALLEL, GroupReplicatedSampler
from .diffusion_dpo_config import DiffusionDPOConfig
from .diffusion_trainer import DiffusionTrainer, load_pipeline
from .evaluation import evaluation_policy, pipeline_call_defaults
from .pair_denoising import PairDenoising, reward_metrics

logger = logging.getLogger(__name__)


class DiffusionDPOTrainer(DiffusionTrainer):
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
        if isinstance(train_dataset, IterableDataset) and args.max_steps <= 0:
            raise ValueError("a streaming (Iterable) train_dataset has no length: set max_steps > 0")
        if isinstance(train_dataset, IterableDataset) and args.context_parallel_size > 1:
            raise ValueError(STREAMING_WITH_CONTEXT_PARALLEL)
        if args.eval_strategy != "no" and eval_dataset is None and not args.eval_prompts:
            strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
            raise ValueError(f"eval_strategy={strategy!r} needs an eval_dataset or eval_prompts")
        train_dataset, self.num_ties_dropped, self.data_format = self._prepare_pairs(
            train_dataset, args, "train_dataset"
        )
        if eval_dataset is not None:
            eval_dataset, *_ = self._prepare_pairs(eval_dataset, args, "eval_dataset")
            if isinstance(eval_dataset, IterableDataset):  # evaluated whole at every evaluation: read it once
                eval_dataset = list(eval_dataset)
        self._missing_images, self._warned_missing = 0, False

        settings = SamplerSettings(
            height=args.resolution,
            width=args.resolution,
            guidance_scale=args.guidance_scale,
            max_sequence_length=args.max_sequence_length,
            num_frames=args.num_frames,
        )
        pipeline = load_pipeline(model, args)
        policy = make_policy(pipeline, settings)
        if policy.condition_columns:
            raise ValueError(
                f"DiffusionDPOTrainer learns text-to-image and text-to-video pairs; {type(pipeline).__name__} "
                f"conditions on {list(policy.condition_columns)} (editing, image-to-video), which it does not handle"
            )
        if policy.supports_cfg:
            settings.guidance_scale = 1.0  # DPO trains the conditional prediction; CFG belongs to sampling
        self.needs_reference = args.needs_reference
        # Video models: clips of the policy's frame count (its family's default when num_frames is None).
        self._clip_frames = policy.settings.num_frames if policy.is_video else None
        collator = data_collator or PreferenceCollator(
            args.resolution,
            args.random_crop,
            args.random_flip,
            args.proportion_empty_prompts,
            seed=args.seed + 7919 * (args.process_index // args.context_parallel_size),  # per data-parallel rank
            num_frames=self._clip_frames,
        )
        super().__init__(
            policy,
            args,
            peft_config,
            need_reference=self.needs_reference,
            ref_model=self._reference_denoiser(ref_model, policy, args),
            data_collator=collator,
            train_dataset=train_dataset,
            # With eval_prompts alone, an empty list: the Trainer refuses an eval_strategy without an eval_dataset.
            eval_dataset=eval_dataset if eval_dataset is not None or not args.eval_prompts else [],
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._noise_generator = torch.Generator(device=self.accelerator.device).manual_seed(
            args.seed + 7919 * (self.data_parallel.rank + 1)
        )
        self.pairs = PairDenoising(policy, args)
        self._eval_policy = None  # built at the first evaluation with eval_prompts

    @staticmethod
    def _prepare_pairs(
        dataset, args: DiffusionDPOConfig, name: str
    ) -> tuple[Dataset | IterableDataset, int | None, str]:
        """``dataset`` checked (labels) with ties dropped when ``args.ties == "drop"``, the number dropped (``None``
        for a stream, which drops them as it streams) and its format (``"preference"`` or ``"pickapic"``)."""
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
        return dataset, ties, data_format

    @staticmethod
    def _reference_denoiser(ref_model, policy, args: DiffusionDPOConfig) -> torch.nn.Module | None:
        """The reference denoiser from ``ref_model`` (a pipeline, its Hub id or folder, or a denoiser), or None."""
        if ref_model is None:
            return None
        if isinstance(ref_model, (str, DiffusionPipeline)):
            ref_model = getattr(load_pipeline(ref_model, args), policy.denoiser_name, None)
        if type(ref_model) is not type(policy.denoiser):
            raise ValueError(
                f"ref_model must be a {type(policy.denoiser).__name__} (or a pipeline holding one as "
                f"{policy.denoiser_name!r}) like the trained model's; got {type(ref_model).__name__}"
            )
        return ref_model

    def get_train_dataloader(self):
        if not isinstance(self.train_dataset, Dataset):
            return super().get_train_dataloader()
        return self._get_dataloader(
            dataset=IndexedRows(self.train_dataset),  # each batch's augmentation seeded by its rows
            description="Training",
            batch_size=self._train_batch_size,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _count_missing_images(self, missing: int) -> None:
        if not missing:
            return
        self._missing_images += missing
        if not self._warned_missing and self.accelerator.is_main_process:
            logger.warning(
                f"Diffusion-DPO: skipped a pair whose image is missing (no such file, or no bytes); counted in "
                f"data/missing_images, training stops after {self.args.max_missing_images} per process. Warned once."
            )
            self._warned_missing = True
        limit = self.args.max_missing_images
        if limit is not None and self._missing_images > limit:
            raise ValueError(
                f"{self._missing_images} pairs had a missing image, more than max_missing_images ({limit}): check "
                "the dataset's image paths (relative paths resolve from the working directory)"
            )

    def _resume_state(self) -> dict[str, Any]:
        return {"noise_generator": self._noise_generator.get_state()}  # the timesteps and noise still to draw

    def _restore_resume_state(self, state: dict[str, Any]) -> None:
        self._noise_generator.set_state(state["noise_generator"])

    def _get_train_sampler(self, dataset=None):
        dp = self.data_parallel
        if dp.group == 1:
            return super()._get_train_sampler(dataset)
        # The ranks of a context-parallel group read the same pairs: one seeded order, each block handed to the group.
        order = torch.utils.data.RandomSampler(
            dataset if dataset is not None else self.train_dataset,
            generator=torch.Generator().manual_seed(self.args.seed),
        )
        return GroupReplicatedSampler(order, self.args.per_device_train_batch_size, dp.size, dp.group)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "chosen", "rejected", "caption", "jpg_0", "jpg_1", "label_0"]

    def _pair_errors(self, model, inputs: dict[str, Any], generators: list[torch.Generator] | None = None):
        """Per-sample denoising errors (2B,) float32 of the policy and of the reference (None without one), and the
        policy's prediction, for a collated batch. Noise and times come from the training generator, or pair ``b``'s
        latents, noise and time from the CPU generator ``generators[b]`` (evaluation: independent of batching)."""
        # (2B, ...): w0, l0, w1, l1, ...; the VAE's posterior sample too is drawn from the pair's generator
        per_image = None if generators is None else [g for g in generators for _ in range(2)]
        latents = self.policy.encode_images(inputs["pixel_values"].flatten(0, 1), per_image)
        cond = {k: v.repeat_interleave(2, dim=0) for k, v in self.policy.encode_prompts(inputs["prompts"]).items()}
        cond |= {key: inputs[key].repeat_interleave(2, dim=0) for key in self.policy.batch_conditions}
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
        self._count_missing_images(inputs["num_missing"])
        losses, chosen, rejected, correct = self.pairs.losses(errors, ref_errors, inputs["weights"])
        if ref_errors is not None:
            self._record("mse/chosen/ref", ref_errors[0::2])
            self._record("mse/rejected/ref", ref_errors[1::2])
            for name, values in reward_metrics(chosen, rejected, correct).items():
                self._record(name, values)
        loss = losses.mean()
        return (loss, prediction) if return_outputs else loss

    # ----------------------------------------------------------------------------------------------------------
    # Evaluation

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate on ``eval_dataset`` (default: the trainer's) and sample ``eval_prompts``; call on every process.

        Pairs: centre crops, no flips or caption dropout, and per pair a timestep and noise drawn from (``eval_seed``,
        row index), so evaluations at different steps (and on any number of processes) see the same draws; the policy
        with its EMA when kept. Logs and returns ``{prefix}_loss``, ``{prefix}_rewards/chosen|rejected|accuracies|
        margins`` (TRL's names), ``{prefix}_implicit_acc``, ``{prefix}_margin``. Prompts: the deterministic sampler
        with the ``eval_*`` settings (default: the pipeline's), to the trackers and ``{prefix}_samples_step<N>.png``.
        """
        args = self.args
        dataset = self.eval_dataset if self.eval_dataset else None
        if eval_dataset is not None:
            dataset, *_ = self._prepare_pairs(eval_dataset, args, "eval_dataset")
        if dataset is None and not args.eval_prompts:
            raise ValueError("evaluate needs an eval_dataset (given here or to the trainer) or eval_prompts")
        metrics = {}
        if dataset is not None:
            with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
                metrics = self._evaluate_pairs(list(dataset) if isinstance(dataset, IterableDataset) else dataset)
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in metrics.items()}
        self.log(metrics)  # first: a tracker's writer may open at its first log
        if args.eval_prompts:
            if self._eval_policy is None:
                self._eval_policy = evaluation_policy(
                    self.policy, args, sigma_schedule="pipeline", **pipeline_call_defaults(self.policy.pipeline)
                )
            rows = [{"prompt": prompt} for prompt in args.eval_prompts]
            images = torch.cat([images for _, images in self._eval_samples(self._eval_policy, rows)])
            images = self.data_parallel.gather(images)[: len(rows)].cpu()
            self._log_eval_images(images, args.eval_prompts, None, metric_key_prefix)
        self.control = self.callback_handler.on_evaluate(args, self.state, self.control, metrics)
        return metrics

    def _evaluate_pairs(self, dataset) -> dict[str, float]:
        """The eval loss and reward metrics over all pairs of ``dataset``, split over the processes."""
        args = self.args
        collator = PreferenceCollator(
            args.resolution, random_crop=False, random_flip=False, num_frames=self._clip_frames
        )
        indices = list(range(len(dataset)))
        stats = []
        with self.data_parallel.split(indices) as mine:
            for start in range(0, len(mine), args.per_device_eval_batch_size):
                rows = mine[start : start + args.per_device_eval_batch_size]
                batch = collator([{**dataset[i], INDEX_KEY: i} for i in rows])
                if batch["num_missing"]:
                    raise ValueError(
                        f"eval_dataset: {batch['num_missing']} of rows {rows} have a missing image; evaluation needs "
                        "every pair (the same pairs at every evaluation)"
                    )
                generators = [torch.Generator().manual_seed(mix_seed(args.eval_seed, i)) for i in rows]
                with torch.no_grad(), self.compute_loss_context_manager():
                    errors, ref_errors, _ = self._pair_errors(self.model, self._prepare_inputs(batch), generators)
                    losses, chosen, rejected, correct = self.pairs.losses(errors, ref_errors, batch["weights"])
                stats.append(torch.stack([losses, chosen, rejected, correct], dim=1))
        stats = self.data_parallel.gather(torch.cat(stats))[: len(dataset)]  # (n, 4), padding dropped
        metrics = {"loss": stats[:, 0].mean().item()}
        if self.needs_reference:
            named = reward_metrics(stats[:, 1], stats[:, 2], stats[:, 3])
            metrics |= {name: values.mean().item() for name, values in named.items()}
        return metrics

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
