"""Diffusion-DPO: preference optimization of diffusion and flow models against a frozen reference."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset, IterableDataset
from diffusers import DiffusionPipeline
from diffusers.training_utils import compute_density_for_timestep_sampling
from peft import LoraConfig
from transformers import TrainerCallback

from ..policies import FlowMatchingPolicy, SamplerSettings, StableDiffusionXLPolicy, make_policy, policy_class
from ..preference_data import IndexedRows, PreferenceCollator, check_labels, drop_ties, preference_format
from ..sde import diffusion_target
from .diffusion_dpo_config import DiffusionDPOConfig
from .diffusion_trainer import DiffusionTrainer, load_pipeline

logger = logging.getLogger(__name__)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusion-DPO loss from per-sample denoising errors, all (B,) float32.

    ``z = −β/2 · ((e_θ^w − e_θ^l) − (e_ref^w − e_ref^l))``; loss ``−log σ(z)``, ``relu(1 − z)`` or
    ``(z/β − 1/(2β))²``. ``weights`` (B,) in {1, 0.5}: a pair of weight ½ (a tie) is scored in both orders, half
    each. Returns the mean loss and ``z``.
    """
    z = -0.5 * beta * ((policy_chosen - policy_rejected) - (ref_chosen - ref_rejected))

    def per_pair(logits: torch.Tensor) -> torch.Tensor:
        if loss_type == "sigmoid":
            return -F.logsigmoid(logits)
        if loss_type == "hinge":
            return torch.relu(1 - logits)
        if loss_type == "ipo":
            return (logits / beta - 1 / (2 * beta)) ** 2
        raise ValueError(f"unknown loss_type {loss_type!r}")

    losses = per_pair(z)
    if weights is not None:
        losses = weights * losses + (1 - weights) * per_pair(-z)
    return losses.mean(), z


class DiffusionDPOTrainer(DiffusionTrainer):
    """Diffusion-DPO (arXiv:2311.12908) for SD1.x/SDXL (ε target) and SD3/FLUX (velocity target), on TRL's base.

    Args:
        model: a Hub id or local folder of a diffusers pipeline, or a pipeline instance.
        args: the configuration.
        train_dataset: rows in TRL's preference format (``prompt``, ``chosen``, ``rejected`` images) or Pick-a-Pic's
            (``caption``, ``jpg_0``, ``jpg_1``, ``label_0``), a ``Dataset`` or a streaming ``IterableDataset`` (then
            ``max_steps`` sets the length; ties are dropped as they stream). Images are decoded and transformed per
            batch.
        peft_config: a ``peft.LoraConfig``; the reference is then the model with the adapter disabled (no copy).
            ``None`` fine-tunes the whole denoiser against a frozen copy.
        callbacks, optimizers: as in ``transformers.Trainer``.
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
        args: DiffusionDPOConfig | None = None,
        train_dataset: Dataset | None = None,
        peft_config: LoraConfig | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
    ):
        args = self._resolve_args(model, args, DiffusionDPOConfig, "DiffusionDPO")
        if not isinstance(train_dataset, (Dataset, IterableDataset)):
            raise TypeError(
                f"train_dataset must be a datasets.Dataset or IterableDataset, got {type(train_dataset).__name__}"
            )
        streaming = isinstance(train_dataset, IterableDataset)
        if streaming and args.max_steps <= 0:
            raise ValueError("a streaming (Iterable) train_dataset has no length: set max_steps > 0")
        columns = train_dataset.column_names
        if columns is None:  # a stream whose features are not declared: read them off its first row
            columns = list(next(iter(train_dataset)))
        self.data_format = preference_format(columns)
        self.num_ties_dropped = 0
        if self.data_format == "pickapic" and not streaming:
            check_labels(train_dataset)
        if self.data_format == "pickapic" and args.ties == "drop":
            train_dataset, self.num_ties_dropped = drop_ties(train_dataset)
            if not streaming:
                logger.warning(
                    f"Diffusion-DPO: dropped {self.num_ties_dropped} ties; {len(train_dataset)} pairs remain"
                )
        if not streaming and len(train_dataset) == 0:
            ties = (
                f" ({self.num_ties_dropped} ties were dropped; ties='keep' trains on them)"
                if self.num_ties_dropped
                else ""
            )
            raise ValueError(f"train_dataset has no preference pairs to train on{ties}")
        self._missing_images, self._warned_missing = 0, False

        settings = SamplerSettings(
            height=args.resolution,
            width=args.resolution,
            guidance_scale=args.guidance_scale,
            max_sequence_length=args.max_sequence_length,
        )
        pipeline = load_pipeline(model, args)
        if policy_class(pipeline).is_video:
            raise ValueError(
                f"DiffusionDPOTrainer learns from image pairs; {type(pipeline).__name__} generates videos"
            )
        policy = make_policy(pipeline, settings)
        if policy.supports_cfg:
            settings.guidance_scale = 1.0  # DPO trains the conditional prediction; CFG belongs to sampling
        collator = PreferenceCollator(
            args.resolution,
            args.random_crop,
            args.random_flip,
            args.proportion_empty_prompts,
            seed=args.seed + 7919 * args.process_index,
        )
        super().__init__(
            policy,
            args,
            peft_config,
            need_reference=not args.sft,
            data_collator=collator,
            train_dataset=train_dataset,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._noise_generator = torch.Generator(device=self.accelerator.device).manual_seed(
            args.seed + 7919 * (self.accelerator.process_index + 1)
        )
        if isinstance(policy, FlowMatchingPolicy):
            # A fresh copy's T_train σ values, from 1 down to 1/T_train, with the config's static shift (SD3: 3).
            scheduler = policy.pipeline.scheduler
            self._training_sigmas = type(scheduler).from_config(scheduler.config).sigmas.float().cpu()

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

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "chosen", "rejected", "caption", "jpg_0", "jpg_1", "label_0"]

    def _noise_and_timesteps(self, latents: torch.Tensor):
        """Per pair one noise and one timestep, shared by its two images (latents ordered w0, l0, w1, l1, ...).

        Returns the noisy latents, the target (ε or ε − x0) and the denoiser's timesteps, all for 2B images.
        """
        pairs = latents.shape[0] // 2
        device, gen = latents.device, self._noise_generator
        noise = torch.randn(latents[::2].shape, generator=gen, device=device).repeat_interleave(2, dim=0)
        shape = (-1,) + (1,) * (latents.ndim - 1)
        if isinstance(self.policy, FlowMatchingPolicy):
            args = self.args
            u = compute_density_for_timestep_sampling(
                args.weighting_scheme, pairs, args.logit_mean, args.logit_std, args.mode_scale, device, gen
            )
            grid = self._training_sigmas.to(device)  # the scheduler's training σ, shifted as the pipeline trains
            sigma = grid[(u * len(grid)).long().clamp_max(len(grid) - 1)].repeat_interleave(2)
            noisy = (1 - sigma.view(shape)) * latents + sigma.view(shape) * noise
            return noisy, noise - latents, self.policy.timestep_from_sigma(sigma)
        scheduler = self.policy.scheduler
        timesteps = torch.randint(
            0, scheduler.config.num_train_timesteps, (pairs,), generator=gen, device=device
        ).repeat_interleave(2)
        alpha = scheduler.alphas_cumprod.to(device)[timesteps].view(shape)
        noisy = alpha.sqrt() * latents + (1 - alpha).sqrt() * noise
        return noisy, diffusion_target(latents, noise, alpha, self.policy.prediction_type), timesteps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        pixels = inputs["pixel_values"]  # (B, 2, 3, R, R), chosen first
        latents = self.policy.encode_images(pixels.flatten(0, 1))  # (2B, ...): w0, l0, w1, l1, ...
        cond = {k: v.repeat_interleave(2, dim=0) for k, v in self.policy.encode_prompts(inputs["prompts"]).items()}
        if isinstance(self.policy, StableDiffusionXLPolicy):
            cond["time_ids"] = inputs["time_ids"].repeat_interleave(2, dim=0)
        noisy, target, timesteps = self._noise_and_timesteps(latents)
        dims = tuple(range(1, latents.ndim))

        prediction = self.policy.predict_at(model, noisy, timesteps, cond)
        errors = ((prediction - target.float()) ** 2).mean(dim=dims)
        policy_chosen, policy_rejected = errors[0::2], errors[1::2]
        self._record("mse/chosen/policy", policy_chosen)
        self._record("mse/rejected/policy", policy_rejected)
        self._record("data/missing_images", torch.tensor([float(inputs["num_missing"])], device=errors.device))
        self._count_missing_images(inputs["num_missing"])
        if self.args.sft:
            loss = policy_chosen.mean()
            return (loss, prediction) if return_outputs else loss

        reference = self.reference_prediction(model, noisy, timesteps, cond)
        ref_errors = ((reference - target.float()) ** 2).mean(dim=dims)
        ref_chosen, ref_rejected = ref_errors[0::2], ref_errors[1::2]
        weights = inputs["weights"]
        loss, z = dpo_loss(
            policy_chosen,
            policy_rejected,
            ref_chosen,
            ref_rejected,
            self.args.beta,
            self.args.loss_type,
            weights,
        )
        with torch.no_grad():
            # A tie, or z = 0 exactly (policy == reference), counts ½.
            correct = torch.where(z == 0, torch.full_like(z, 0.5), (z > 0).float())
            correct = torch.where(weights < 1, torch.full_like(z, 0.5), correct)
            self._record("mse/chosen/ref", ref_chosen)
            self._record("mse/rejected/ref", ref_rejected)
            self._record("implicit_acc", correct)
            self._record("margin", z)
        return (loss, prediction) if return_outputs else loss

    def _model_card_details(self) -> dict[str, str]:
        args = self.args
        mode = "SFT on the chosen images" if args.sft else f"{args.loss_type} loss, β {args.beta:g}"
        return {
            "Diffusion-DPO": f"{mode}, {args.resolution} px, ties {args.ties}, caption dropout {args.proportion_empty_prompts}"
        }

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.num_ties_dropped:
            logs["data/ties_dropped"] = self.num_ties_dropped
        super().log(logs, start_time)


__all__ = ["DiffusionDPOTrainer", "dpo_loss"]
