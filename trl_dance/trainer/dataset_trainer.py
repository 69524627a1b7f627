"""The base of the trainers that learn from datasets of real images or videos (Diffusion-DPO, SFT): the pipeline and
policy from the config, the collated rows, the seeded noise of the forward process, missing images, evaluation."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from transformers import TrainerCallback

from ..policies import SamplerSettings, make_policy
from ..preference_data import INDEX_KEY, IndexedRows
from ..sampling import mix_seed
from .context_parallel import STREAMING_WITH_CONTEXT_PARALLEL, GroupReplicatedSampler
from .dataset_config import DatasetTrainingConfig
from .diffusion_trainer import DiffusionTrainer, denoiser_like, load_pipeline
from .evaluation import evaluation_policy, pipeline_call_defaults

logger = logging.getLogger(__name__)


class DatasetTrainer(DiffusionTrainer):
    """A :class:`DiffusionTrainer` on a dataset of rows holding real images or videos. Subclasses give
    :meth:`_prepare_dataset` (checks a dataset), :meth:`_collator` (rows → batch), ``compute_loss`` and
    :meth:`_evaluation_losses`; ``_row`` names a row in messages ("pair", "row")."""

    _row = "row"

    def __init__(
        self,
        model: str | DiffusionPipeline,
        args: DatasetTrainingConfig,
        data_collator: Callable[[list[dict[str, Any]]], dict[str, Any]] | None,
        train_dataset: Dataset | IterableDataset | None,
        eval_dataset: Dataset | IterableDataset | None,
        callbacks: list[TrainerCallback] | None,
        optimizers: tuple[torch.optim.Optimizer | None, Any],
        peft_config: LoraConfig | None,
        need_reference: bool = False,
        ref_model: str | DiffusionPipeline | torch.nn.Module | None = None,
    ):
        if isinstance(train_dataset, IterableDataset) and args.max_steps <= 0:
            raise ValueError("a streaming (Iterable) train_dataset has no length: set max_steps > 0")
        if isinstance(train_dataset, IterableDataset) and args.context_parallel_size > 1:
            raise ValueError(STREAMING_WITH_CONTEXT_PARALLEL)
        if args.eval_strategy != "no" and eval_dataset is None and not args.eval_prompts:
            strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
            raise ValueError(f"eval_strategy={strategy!r} needs an eval_dataset or eval_prompts")
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
                f"{type(self).__name__} learns text-to-image and text-to-video data; {type(pipeline).__name__} "
                f"conditions on {list(policy.condition_columns)} (editing, image-to-video), which it does not handle"
            )
        if policy.has_audio:
            raise ValueError(
                f"{type(self).__name__} learns from real videos; {type(pipeline).__name__} denoises each video with its "
                "soundtrack, which trl-dance does not encode from data yet (its rollout trainers train it)"
            )
        if policy.supports_cfg:  # the loss trains the conditional prediction; CFG belongs to sampling
            policy = make_policy(pipeline, dataclasses.replace(settings, guidance_scale=1.0))
        # Video models: clips of the policy's frame count (its family's default when num_frames is None).
        self._clip_frames = policy.settings.num_frames if policy.is_video else None
        train_dataset = self._prepare_dataset(train_dataset, args, "train_dataset", policy)
        if eval_dataset is not None:
            eval_dataset = self._prepare_dataset(eval_dataset, args, "eval_dataset", policy)
            if isinstance(eval_dataset, IterableDataset):  # evaluated whole at every evaluation: read it once
                eval_dataset = list(eval_dataset)
        self._missing_images, self._warned_missing = 0, False
        super().__init__(
            policy,
            args,
            peft_config,
            need_reference=need_reference,
            ref_model=self._reference_denoiser(ref_model, policy, args),
            data_collator=data_collator,
            train_dataset=train_dataset,
            # With eval_prompts alone, an empty list: the Trainer refuses an eval_strategy without an eval_dataset.
            eval_dataset=eval_dataset if eval_dataset is not None or not args.eval_prompts else [],
            callbacks=callbacks,
            optimizers=optimizers,
        )
        if data_collator is None:  # crops, flips and caption dropout: seeded per data-parallel rank (a group alike)
            self.data_collator = self._collator(args, args.seed + 7919 * self.data_parallel.rank, training=True)
        self._noise_generator = torch.Generator(device=self.accelerator.device).manual_seed(
            args.seed + 7919 * (self.data_parallel.rank + 1)
        )
        self._eval_policy = None  # built at the first evaluation with eval_prompts

    def _prepare_dataset(self, dataset, args, name: str, policy) -> Dataset | IterableDataset:
        """``dataset`` checked (and possibly filtered) for training; ``name`` for errors."""
        raise NotImplementedError

    def _collator(self, args, seed: int, training: bool) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        """The collator of training rows (random crops and flips as configured) or of evaluation rows (centred, no
        flip, no caption dropout)."""
        raise NotImplementedError

    def _evaluation_losses(self, batch: dict[str, Any], generators: list[torch.Generator]) -> dict[str, torch.Tensor]:
        """Per-row evaluation statistics (each (B,)) of a collated batch, row ``b``'s draws from ``generators[b]``;
        ``loss`` among them."""
        raise NotImplementedError

    @staticmethod
    def _reference_denoiser(ref_model, policy, args) -> torch.nn.Module | None:
        """The reference denoiser from ``ref_model`` (a pipeline, its Hub id or folder, or a denoiser), or None."""
        if ref_model is None:
            return None
        if isinstance(ref_model, str):
            ref_model = load_pipeline(ref_model, args)
        return denoiser_like(ref_model, policy, "ref_model")

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

    def _encode_batch(self, inputs: dict[str, Any], generators: list[torch.Generator] | None, repeat: int = 1):
        """The clean latents of a batch's ``pixel_values`` (flattened over its first two dimensions) and their
        conditioning, each prompt's repeated ``repeat`` times (a pair's two images); with ``generators``, the VAE's
        posterior sample of image ``i`` from ``generators[i // repeat]``."""
        per_image = None if generators is None else [g for g in generators for _ in range(repeat)]
        pixels = inputs["pixel_values"]
        latents = self.policy.encode_images(pixels.flatten(0, 1) if repeat > 1 else pixels, per_image)
        cond = self.policy.encode_prompts(inputs["prompts"])
        cond |= {key: inputs[key] for key in self.policy.batch_conditions}
        return latents, {k: v.repeat_interleave(repeat, dim=0) for k, v in cond.items()}

    def _count_missing_images(self, missing: list[str]) -> None:
        """Count the batch's skipped rows (``missing``: each one's description, naming its row and file)."""
        if not missing:
            return
        self._missing_images += len(missing)
        if not self._warned_missing and self.accelerator.is_main_process:
            logger.warning(
                f"{self._name}: skipped a {self._row} whose image is missing or cannot be decoded: "
                f"{'; '.join(missing[:3])}. Counted in "
                f"data/missing_images, training stops after {self.args.max_missing_images} per process. Warned once."
            )
            self._warned_missing = True
        limit = self.args.max_missing_images
        if limit is not None and self._missing_images > limit:
            raise ValueError(
                f"{self._missing_images} {self._row}s had a missing image, more than max_missing_images ({limit}): "
                "check the dataset's image paths (relative paths resolve from the working directory)"
            )

    def _resume_state(self) -> dict[str, Any]:
        return {"noise_generator": self._noise_generator.get_state()}  # the timesteps and noise still to draw

    def _restore_resume_state(self, state: dict[str, Any]) -> None:
        self._noise_generator.set_state(state["noise_generator"])

    _update_boundary_state, _restore_update_boundary_state = _resume_state, _restore_resume_state

    def _get_train_sampler(self, dataset=None):
        dp = self.data_parallel
        if dp.group == 1:
            return super()._get_train_sampler(dataset)
        # The ranks of a context-parallel group read the same rows: one seeded order, each block handed to the group.
        order = torch.utils.data.RandomSampler(
            dataset if dataset is not None else self.train_dataset,
            generator=torch.Generator().manual_seed(self.args.seed),
        )
        return GroupReplicatedSampler(order, self.args.per_device_train_batch_size, dp.size, dp.group)

    # ----------------------------------------------------------------------------------------------------------
    # Evaluation

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate on ``eval_dataset`` (default: the trainer's) and sample ``eval_prompts``; call on every process.

        Rows: centre crops, no flips or caption dropout, and per row a timestep and noise drawn from (``eval_seed``,
        row index), so evaluations at different steps (and on any number of processes) see the same draws; the policy
        with its EMA when kept. Logs and returns ``{prefix}_loss`` and the trainer's other statistics (their means).
        Prompts: the deterministic sampler with the ``eval_*`` settings (default: the pipeline's), to the trackers and
        ``{prefix}_samples_step<N>.png``.
        """
        args = self.args
        dataset = self.eval_dataset if self.eval_dataset else None
        if eval_dataset is not None:
            dataset = self._prepare_dataset(eval_dataset, args, "eval_dataset", self.policy)
        if dataset is None and not args.eval_prompts:
            raise ValueError("evaluate needs an eval_dataset (given here or to the trainer) or eval_prompts")
        metrics = {}
        if dataset is not None:
            with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
                metrics = self._evaluate_rows(list(dataset) if isinstance(dataset, IterableDataset) else dataset)
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in metrics.items()}
        self.log(metrics)  # first: a tracker's writer may open at its first log
        if args.eval_prompts:
            if self._eval_policy is None:
                self._eval_policy = evaluation_policy(
                    self.policy, args, sigma_schedule="pipeline", **pipeline_call_defaults(self.policy.pipeline)
                )
            rows = [{"prompt": prompt} for prompt in args.eval_prompts]
            images = torch.cat([samples["images"] for _, samples in self._eval_samples(self._eval_policy, rows)])
            images = self.data_parallel.gather(images)[: len(rows)].cpu()
            self._log_eval_images(images, args.eval_prompts, None, metric_key_prefix)
        self.control = self.callback_handler.on_evaluate(args, self.state, self.control, metrics)
        return metrics

    def _evaluate_rows(self, dataset) -> dict[str, float]:
        """The means of :meth:`_evaluation_losses` over all rows of ``dataset``, split over the processes."""
        args = self.args
        collator = self._collator(args, args.eval_seed, training=False)
        indices = list(range(len(dataset)))
        names, stats = None, []
        with self.data_parallel.split(indices) as mine:
            for start in range(0, len(mine), args.per_device_eval_batch_size):
                rows = mine[start : start + args.per_device_eval_batch_size]
                batch = collator([{**dataset[i], INDEX_KEY: i} for i in rows])
                if batch["num_missing"]:
                    raise ValueError(
                        f"eval_dataset: {batch['num_missing']} of rows {rows} have a missing image; evaluation needs "
                        f"every {self._row} (the same at every evaluation)"
                    )
                generators = [torch.Generator().manual_seed(mix_seed(args.eval_seed, i)) for i in rows]
                with torch.no_grad(), self.compute_loss_context_manager():
                    losses = self._evaluation_losses(self._prepare_inputs(batch), generators)
                names = list(losses)
                stats.append(torch.stack([losses[name] for name in names], dim=1))
        stats = self.data_parallel.gather(torch.cat(stats))[: len(dataset)]  # padding dropped
        return {name: stats[:, i].mean().item() for i, name in enumerate(names)}
