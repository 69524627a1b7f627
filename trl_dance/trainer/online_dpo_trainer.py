"""Online Diffusion-DPO: preference pairs regenerated from the current policy and ranked by rewards (AI feedback)."""

from __future__ import annotations

from typing import Any

import torch

from ..ai_feedback import best_and_worst
from ..policies import DiffusionPolicy
from ..sampling import RolloutPlan
from .online_dpo_config import OnlineDiffusionDPOConfig
from .pair_denoising import PairDenoising, reward_metrics
from .rollout_config import RolloutConfig
from .rollout_trainer import RolloutTrainer


class OnlineDiffusionDPOTrainer(RolloutTrainer):
    """Online Diffusion-DPO (learning from AI feedback, arXiv:2311.12908 §5.3), TRL's ``OnlineDPOTrainer`` for
    diffusion models, on the shared rollout engine.

    Each round the current policy samples ``num_generations`` images per prompt with its deterministic sampler, the
    rewards rank them, and the best and worst of each prompt become a pair; the Diffusion-DPO loss
    (:class:`~trl_dance.trainer.pair_denoising.PairDenoising`: both latents noised with one noise and one time)
    trains on the round's pairs for ``num_iterations`` passes. Every family the engine samples (SD1.x/SDXL, SD3,
    FLUX, Qwen-Image, Wan, ...). The arguments are those of
    :class:`~trl_dance.trainer.rollout_trainer.RolloutTrainer`.
    """

    _tag_names = ["trl", "trl-dance", "online-dpo", "diffusion-dpo", "diffusers"]
    _name = "OnlineDiffusionDPO"
    _paper = {
        "title": "Diffusion Model Alignment Using Direct Preference Optimization",
        "id": "2311.12908",
        "citation": "@inproceedings{wallace2024diffusion,\n  title={Diffusion Model Alignment Using Direct Preference "
        "Optimization},\n  author={Wallace, Bram and others},\n  booktitle={CVPR},\n  year={2024}\n}",
    }
    config_class = OnlineDiffusionDPOConfig
    supports_async_rounds = True  # pairs of clean samples against the reference: no sampling likelihood to correct

    def _check_policy(self, policy: DiffusionPolicy, args: OnlineDiffusionDPOConfig) -> None:
        self.pairs = PairDenoising(policy, args)

    @staticmethod
    def _needs_reference(args: RolloutConfig) -> bool:
        return args.needs_reference

    def rollout_plan(self, round_index: int | None = None) -> RolloutPlan:
        return RolloutPlan.deterministic(self.policy.num_steps)

    def _signal_items(self, advantages: torch.Tensor) -> None:
        return None  # the kept pairs, counted in _plan_round

    def _idle_causes(self) -> tuple[str, str]:
        return (
            f"every pair's reward gap was zero or below min_margin ({self.args.min_margin}): the rewards tie within "
            "every group (check them, raise num_generations) or lower min_margin",
            "the loss's gradient was exactly zero in every update",
        )

    def _plan_round(self, rollout: dict[str, torch.Tensor], plan: RolloutPlan, advantages: torch.Tensor) -> list:
        """Each prompt's best and worst sample (the process holds whole groups), then per iteration a shuffle of the
        pairs into micro-batches, each pair with a fresh noise seed (host integers: no device read)."""
        args, group = self.args, self.args.num_generations
        rewards = self._rollout["rewards"].view(-1, group)
        best, worst, keep = best_and_worst(rewards, args.min_margin)
        self.training_signal.add_items(keep.sum())
        offsets = torch.arange(len(best), device=best.device) * group
        self._rollout |= {
            "x0": rollout["final_latents"],
            "chosen": offsets + best,
            "rejected": offsets + worst,
            "keep": keep,
            "gap": rewards.max(dim=1).values - rewards.min(dim=1).values,
        }
        count, items = len(advantages) // group, []
        for _ in range(args.num_iterations):
            order = torch.randperm(count, generator=self._cpu_generator)
            seeds = torch.randint(2**62, (count,), generator=self._cpu_generator)
            size = args.per_device_train_batch_size
            items.extend(zip(order.split(size), (s.tolist() for s in seeds[order].split(size))))
        return items

    def _microbatch(self, item: tuple[torch.Tensor, list[int]]) -> dict[str, Any]:
        rollout, device = self._rollout, self.accelerator.device
        pairs, seeds = item
        pairs = pairs.to(device)
        rows = torch.stack([rollout["chosen"][pairs], rollout["rejected"][pairs]], dim=1).flatten()  # w0, l0, w1, ...
        return {
            "latents": rollout["x0"][rows],
            "cond": self._round_cond(rows),
            "keep": rollout["keep"][pairs].float(),
            "gap": rollout["gap"][pairs],
            "generators": [torch.Generator().manual_seed(seed) for seed in seeds],
        }

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        latents, keep = inputs["latents"], inputs["keep"]
        draws = self.pairs.draw_per_pair(latents[::2].shape, inputs["generators"], latents.device)
        errors, ref_errors, prediction = self.pairs.errors(self, model, latents, inputs["cond"], draws)
        losses, chosen, rejected, correct = self.pairs.losses(errors, ref_errors, torch.ones_like(keep))
        loss = (losses * keep).sum() / keep.sum().clamp_min(1)  # pairs below min_margin train nothing
        self._record("pairs/kept", keep)
        self._record("pairs/reward_gap", inputs["gap"])
        self._record("mse/chosen/policy", errors[0::2])
        self._record("mse/rejected/policy", errors[1::2])
        if ref_errors is not None:
            self._record("mse/chosen/ref", ref_errors[0::2])
            self._record("mse/rejected/ref", ref_errors[1::2])
            for name, values in reward_metrics(chosen, rejected, correct).items():
                self._record(name, values)
        return (loss, prediction) if return_outputs else loss

    def _model_card_details(self) -> dict[str, str]:
        args = self.args
        return super()._model_card_details() | {
            "sampling": f"{args.num_inference_steps} deterministic steps, guidance {args.guidance_scale}, "
            f"{self._sample_size()}",
            "online DPO": f"best vs worst of {args.num_generations} samples per prompt (min margin {args.min_margin}), "
            f"{' + '.join(args.loss_type)} loss, β {args.beta:g}, {args.num_iterations} passes per round",
        }


__all__ = ["OnlineDiffusionDPOTrainer"]
