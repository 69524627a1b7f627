"""DiffusionNFT: online RL on the forward process, from deterministic rollouts and their clean samples."""

from __future__ import annotations

from typing import Any

import torch

from ..losses import (
    awm_log_ratio,
    clipped_fraction,
    clipped_surrogate,
    dgpo_loss,
    flow_matching_error,
    nft_loss,
    optimality_probability,
)
from ..policies import DiffusionPolicy, FlowMatchingPolicy
from ..sampling import RolloutPlan
from .diffusion_nft_config import DiffusionNFTConfig
from .old_policy import OldPolicy, nft_decay
from .online_trainer import OnlineDiffusionTrainer


class DiffusionNFTTrainer(OnlineDiffusionTrainer):
    """DiffusionNFT (Zheng et al., arXiv:2509.16117), with AWM and DGPO as ``loss_type``, on TRL's Trainer machinery.

    Each round, the *old* policy (a soft-updated copy of the trained parameters, see
    :class:`~trl_dance.trainer.old_policy.OldPolicy`) samples ``generation_batch_size`` images with a deterministic
    solver (no SDE, no log-probabilities; no CFG by default) and only each sample's final latent x0 is kept. Rewards
    become group advantages as in GRPO and then optimality probabilities r = clip(½ + A/(2·adv_clip_max), 0, 1). Each
    sample is re-noised with fresh noise to K noise levels of the rollout grid, x_σ = (1 − σ)·x0 + σ·ε, and the loss
    (:func:`~trl_dance.losses.nft_loss`) moves the implicit positive policy toward x0 in proportion to r and the
    implicit negative one in proportion to 1 − r. After the round's updates the old policy moves toward the trained
    one (``old_policy_decay``). ``loss_type="awm"`` and ``"dgpo"`` replace that loss on the same items (see
    :class:`~trl_dance.DiffusionNFTConfig`).

    Flow-matching pipelines (FLUX, SD3, Wan text-to-video and Wan 2.1 image-to-video). The arguments are those of
    :class:`~trl_dance.trainer.online_trainer.OnlineDiffusionTrainer`.
    """

    _tag_names = ["trl", "trl-dance", "diffusion-nft", "diffusers"]
    _name = "DiffusionNFT"
    _paper = {
        "title": "DiffusionNFT: Online Diffusion Reinforcement with Forward Process",
        "id": "2509.16117",
        "citation": "@article{zheng2025diffusionnft,\n  title={DiffusionNFT: Online Diffusion Reinforcement with Forward "
        "Process},\n  author={Zheng, Kaiwen and others},\n  journal={arXiv preprint arXiv:2509.16117},\n  year={2025}\n}",
    }
    config_class = DiffusionNFTConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.parameter_sharding is not None:
            raise ValueError(
                f"DiffusionNFTTrainer keeps an old copy of the trained parameters, which {self.parameter_sharding} "
                "shards: use DeepSpeed ZeRO-2 (--accelerate_config zero2) or DDP"
            )
        self.old_policy = OldPolicy(self.policy.denoiser)

    def _check_policy(self, policy: DiffusionPolicy, args: DiffusionNFTConfig) -> None:
        name = type(policy.pipeline).__name__
        if not isinstance(policy, FlowMatchingPolicy):
            raise ValueError(
                f"DiffusionNFT trains velocity predictions of flow-matching models; {name} predicts "
                f"{getattr(policy, 'prediction_type', 'noise')} (SD1.x/SDXL): use DanceGRPOTrainer or DiffusionDPOTrainer"
            )
        if getattr(policy, "_first_frame_given", False):
            raise ValueError(
                f"{name} gives the first latent frame (Wan 2.2 TI2V image-to-video); the forward-process loss would "
                "train it: not supported yet"
            )
        self._grid = tuple(policy.sigmas.tolist())  # the rollout's σ grid, read once
        levels = policy.trained_denoiser_steps()
        if args.timesteps_per_sample > len(levels):
            raise ValueError(
                f"timestep_fraction {args.timestep_fraction} trains {args.timesteps_per_sample} noise levels per "
                f"sample, but the trained denoiser serves {len(levels)} of the {policy.num_steps} ({levels})"
            )

    @staticmethod
    def _needs_reference(args: DiffusionNFTConfig) -> bool:
        return args.beta > 0 or args.loss_type == "dgpo"

    # ----------------------------------------------------------------------------------------------------------
    # Rounds

    def rollout_plan(self, round_index: int | None = None) -> RolloutPlan:
        steps = self.policy.num_steps
        if self.args.rollout_solver == "ode":
            return RolloutPlan.deterministic(steps)
        return RolloutPlan.deterministic(steps, post_window_sigmas=self._grid, post_window_solver="dpm_solver++")

    def _rollout_model(self) -> torch.nn.Module:
        return self.old_policy.model

    def _generate_and_score(self, rows: list[dict[str, Any]]) -> None:
        if self._generation_round > 0:  # after the previous round's updates
            decay = nft_decay(self.state.global_step, self.args.old_policy_decay)
            self.old_policy.update(decay)
            self._metrics["old_policy/decay"].append(torch.tensor(decay))
        super()._generate_and_score(rows)

    def _plan_round(self, rollout: dict[str, torch.Tensor], plan: RolloutPlan, advantages: torch.Tensor) -> list:
        """Items (sample, grid index, noise seed): K distinct levels per sample and fresh noise in every iteration. For
        DGPO a whole group shares each level and noise, and micro-batches hold whole groups (consecutive rows)."""
        args = self.args
        self._rollout["x0"] = rollout["final_latents"]
        levels = torch.tensor(self.policy.trained_denoiser_steps())  # the grid σ the items are noised to
        # The unit drawn: a sample, or for DGPO a group (which every process holds whole).
        group = args.num_generations if args.loss_type == "dgpo" else 1
        units, k = len(advantages) // group, args.timesteps_per_sample
        members = torch.arange(group)
        items = []
        for _ in range(args.num_iterations):
            draws = torch.rand(units, len(levels), generator=self._cpu_generator).argsort(dim=1)[:, :k].flatten()
            seeds = torch.randint(2**62, (units * k,), generator=self._cpu_generator)
            order = torch.randperm(units * k, generator=self._cpu_generator)
            unit = torch.arange(units).repeat_interleave(k)[order]
            samples = (unit[:, None] * group + members).flatten()
            chosen = levels[draws[order]].repeat_interleave(group)
            noise = seeds[order].repeat_interleave(group)
            size = args.per_device_train_batch_size
            # Seeds as host integers: a micro-batch draws its noise without reading a tensor.
            items.extend(zip(samples.split(size), chosen.split(size), (c.tolist() for c in noise.split(size))))
        return items

    def _microbatch(self, item: tuple[torch.Tensor, torch.Tensor, list[int]]) -> dict[str, Any]:
        rollout, device = self._rollout, self.accelerator.device
        samples, levels, seeds = item
        x0 = rollout["x0"][samples.to(device)]
        noise = torch.stack(
            [torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(seed)) for seed in seeds]
        ).to(device)
        sigma = self.policy.sigmas[levels].to(device)
        shape = (-1,) + (1,) * (x0.ndim - 1)
        cond_rows = rollout["prompt_index"][samples.to(device)]
        return {
            "noisy": (1 - sigma.view(shape)) * x0 + sigma.view(shape) * noise,
            "noise": noise,
            "groups": torch.arange(len(seeds), device=device) // self.args.num_generations,  # DGPO: whole groups
            "x0": x0,
            "sigma": sigma,
            "advantages": rollout["advantages"][samples.to(device)],
            "cond": {key: value[cond_rows] for key, value in rollout["cond"].items()},
        }

    # ----------------------------------------------------------------------------------------------------------
    # Loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, policy = self.args, self.policy
        noisy, sigma, cond, x0 = inputs["noisy"], inputs["sigma"], inputs["cond"], inputs["x0"]
        advantages = inputs["advantages"]
        timestep = policy.timestep_from_sigma(sigma)
        velocity = policy.predict_at(model, noisy, timestep, cond)
        dims = tuple(range(1, velocity.ndim))
        reference = self.reference_prediction(model, noisy, timestep, cond) if self._needs_reference(args) else None
        if args.loss_type == "dgpo":
            error = flow_matching_error(velocity, inputs["noise"], x0)
            reference_error = flow_matching_error(reference, inputs["noise"], x0)
            groups = len(sigma) // args.num_generations
            per_item = dgpo_loss(error, reference_error, advantages, inputs["groups"], groups, args.dgpo_beta)
        else:
            with torch.no_grad():
                old_velocity = policy.predict_at(self.old_policy.model, noisy, timestep, cond)
                self._record("old_policy/deviation", ((velocity - old_velocity) ** 2).mean(dim=dims))
            if args.loss_type == "nft":
                r = optimality_probability(advantages, args.adv_clip_max)
                per_item = nft_loss(velocity, old_velocity, noisy, x0, sigma, r, args.nft_beta, args.adv_clip_max)
                self._record("optimality_probability/mean", r)
            else:
                error = flow_matching_error(velocity, inputs["noise"], x0)
                old_error = flow_matching_error(old_velocity, inputs["noise"], x0)
                log_ratio = awm_log_ratio(error, old_error, sigma, args.awm_weighting, args.awm_ghuber_power)
                ratio = torch.exp(log_ratio)
                per_item = clipped_surrogate(ratio, advantages, args.epsilon)
                self._record("clip_ratio/region_mean", clipped_fraction(ratio.detach(), advantages, args.epsilon))
        if args.beta > 0:
            kl = ((velocity - reference) ** 2).mean(dim=dims)
            per_item = per_item + args.beta * kl
            self._record("kl", kl)
        loss = per_item.mean()
        return (loss, velocity) if return_outputs else loss

    # ----------------------------------------------------------------------------------------------------------
    # Model card and checkpoints: the old policy travels with them

    def _model_card_details(self) -> dict[str, str]:
        args = self.args
        return super()._model_card_details() | {
            "sampling": f"{args.num_inference_steps} deterministic steps ({args.rollout_solver}), guidance "
            f"{args.guidance_scale}, {self._sample_size()}",
            "loss": f"{args.loss_type}, {args.num_generations} generations per prompt, NFT β {args.nft_beta}, KL β "
            f"{args.beta}, {args.timesteps_per_sample} noise levels per sample, old-policy decay {args.old_policy_decay}",
        }

    def _resume_state(self) -> dict[str, Any]:
        return super()._resume_state() | {"old_policy": self.old_policy.state_dict()}

    def _restore_resume_state(self, state: dict[str, Any]) -> None:
        super()._restore_resume_state(state)
        self.old_policy.load_state_dict(state["old_policy"])


__all__ = ["DiffusionNFTTrainer"]
