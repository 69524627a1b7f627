"""SPO: step-aware preference optimization on candidate pools sampled along the denoising chain."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from datasets import Dataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from transformers import TrainerCallback

from ..losses import spo_loss
from ..policies import DiffusionPolicy
from ..rewards import RewardFunc, score_images, weighted_reward_sum
from ..rewards.step_aware import StepAwarePreferenceModel
from ..sampling import RolloutPlan, StepScorer, pooled_rollout
from .rollout_trainer import RolloutTrainer
from .spo_config import SPOConfig


class RewardStepScorer:
    """SPO's default step scorer: the weighted sum of reward functions on the decoded predicted clean images (the
    timesteps are ignored: the rewards judge x̂0 as an image). Videos: rewards score ``video_frames`` frames."""

    def __init__(self, reward_funcs: Sequence[RewardFunc], weights: torch.Tensor, video_frames: int | None = 8):
        self.reward_funcs, self.weights, self.video_frames = list(reward_funcs), weights, video_frames

    def __call__(self, prompts: list[str], images: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        scores = score_images(self.reward_funcs, prompts, images, {}, self.video_frames)
        return weighted_reward_sum(scores, self.weights, prompts)


class SPOTrainer(RolloutTrainer):
    """Step-aware Preference Optimization (Liang et al., arXiv:2406.04314, CVPR 2025) on TRL's Trainer machinery.

    Each round, every prompt's chain is denoised with the policy's stochastic step; at each pool step, ``pool_size``
    candidates x_{t−1} are drawn from the shared x_t (:func:`~trl_dance.sampling.pooled_rollout`), a step-aware
    scorer judges them on their predicted clean images, the best and the worst form a pair when their softmax gap
    exceeds ``pair_threshold``, and the chain continues from a random candidate. The loss
    (:func:`~trl_dance.losses.spo_loss`) raises the per-step likelihood ratio to the reference of the preferred
    candidate over the other's, both ratios clipped. The rewards in ``reward_funcs`` also score each round's final
    samples (logged as ``reward``).

    Args:
        model, reward_funcs, args, train_dataset, eval_dataset, callbacks, optimizers, peft_config: as
            :class:`~trl_dance.DanceGRPOTrainer`'s.
        step_scorer: ``(prompts (n), predicted clean images (n, 3, H, W) in [0, 1], model timesteps (n,)) -> (n,)``
            scores; default: SPO's step-aware preference model when ``args.step_aware_model`` names one, else
            :class:`RewardStepScorer` on ``reward_funcs`` (their ``reward_weights``).
    """

    uses_likelihood_ratio = True

    _tag_names = ["trl", "trl-dance", "spo", "diffusers"]
    _name = "SPO"
    _paper = {
        "title": "Aesthetic Post-Training Diffusion Models from Generic Preferences with Step-by-step Preference "
        "Optimization",
        "id": "2406.04314",
        "citation": "@inproceedings{liang2025aesthetic,\n  title={Aesthetic Post-Training Diffusion Models from Generic "
        "Preferences with Step-by-step Preference Optimization},\n  author={Liang, Zhanhao and others},\n  "
        "booktitle={CVPR},\n  year={2025}\n}",
    }
    config_class = SPOConfig
    _synchronous_reason = "SPOTrainer scores its step-wise pools inside the rollout, with the trained weights"

    def __init__(
        self,
        model: str | DiffusionPipeline,
        reward_funcs: RewardFunc | str | Sequence[RewardFunc | str],
        args: SPOConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        peft_config: LoraConfig | None = None,
        step_scorer: StepScorer | None = None,
    ):
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, callbacks, optimizers, peft_config)
        if step_scorer is not None and not callable(step_scorer):
            raise TypeError(f"step_scorer must be callable, got {type(step_scorer).__name__}")
        if step_scorer is None and self.args.step_aware_model is not None:
            kwargs = self.args.step_aware_model_kwargs or {}
            step_scorer = StepAwarePreferenceModel(self.args.step_aware_model, **kwargs)
        self.step_scorer: Callable = step_scorer or RewardStepScorer(
            self.reward_funcs, self.reward_weights, self.args.video_reward_frames
        )

    def _check_policy(self, policy: DiffusionPolicy, args: SPOConfig) -> None:
        self.pool_steps = list(range(args.pool_start_step, policy.num_steps - (0 if args.pool_last_step else 1)))
        untrained = sorted(set(self.pool_steps) - set(policy.trained_denoiser_steps()))
        if untrained:
            raise ValueError(
                f"pool steps {untrained} are served by a frozen expert; pools must be on the trained steps "
                f"{policy.trained_denoiser_steps()}: raise pool_start_step or train the other expert"
            )
        policy.check_schedule()
        if args.pool_last_step:
            last, zeros = torch.tensor([policy.num_steps - 1]), torch.zeros(1, 1)
            if not (policy.step(zeros, zeros, last, prev_sample=zeros, compute_log_prob=False).std > 0).all():
                raise ValueError(
                    f"the last step has no noise (sde_type {args.sde_type!r}, noise level {args.eta}): its pool would "
                    "give identical candidates; set pool_last_step=False"
                )

    @staticmethod
    def _needs_reference(args: SPOConfig) -> bool:
        return True

    _trains_on_advantages = False  # pairs come from the step scorer

    def _advantages(self, all_rewards: torch.Tensor, total: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return torch.zeros_like(total)  # pairs come from the step scorer; the final rewards are only logged

    def _signal_items(self, advantages: torch.Tensor) -> None:
        return None  # the kept pairs, counted in _plan_round

    def _idle_causes(self) -> tuple[str, str]:
        scale = "the round's mean gap" if self.args.score_scale is None else f"score_scale {self.args.score_scale}"
        return (
            f"no pool passed pair_threshold {self.args.pair_threshold} (scores scaled by {scale}): every "
            "candidate scored the same (check the step scorer) or the threshold is too high; lower pair_threshold",
            f"every kept pair's ratios to the reference were outside the clip [1 − {self.args.epsilon}, "
            f"1 + {self.args.epsilon}] (SPO's trust region around the reference is used up: further updates would move "
            "the weights only by optimizer momentum and weight decay); raise epsilon",
        )

    def rollout_plan(self, round_index: int | None = None) -> RolloutPlan:
        return RolloutPlan(self.policy.num_steps)  # only its step count is used: SPO samples pools

    # ----------------------------------------------------------------------------------------------------------
    # Rollout: candidate pools

    @torch.no_grad()
    def sample(
        self,
        prompts,
        generators,
        model=None,
        cond=None,
        initial_noise=None,
        columns=None,
        plan=None,
        groups=None,
        grad_steps=None,
    ):
        """SPO's pooled rollout of B chains (the engine's :meth:`sample` contract: ``final_latents``, ``images``,
        ``denoiser_calls``; plus the pools' ``latents`` (B, S, ...), ``candidates`` (B, S, k, ...), ``scores`` (B, S,
        k) and ``choices`` (B, S)). Chain ``b`` draws its initial noise, every step's k noises and its continuation
        choices from ``generators[b]``. Its calls run without gradients (``grad_steps`` must be None)."""
        if grad_steps is not None:
            raise ValueError("SPO's pooled rollout runs no denoiser call with gradients (grad_steps)")
        args, policy = self.args, self.policy
        model = self.model_wrapped if model is None else model
        if cond is None:
            cond = policy.encode_prompts(prompts, **(columns or {}))
        k, steps, pools = args.pool_size, policy.num_steps, len(self.pool_steps)
        with self.compute_loss_context_manager(), policy.sampling():
            latents = policy.initial_noise(generators) if initial_noise is None else initial_noise
            shape = latents.shape[1:]
            noise = torch.stack([torch.randn((steps, k, *shape), generator=g) for g in generators], dim=2)
            choices = torch.stack([torch.randint(k, (pools,), generator=g) for g in generators], dim=1)  # (S, B)

            # SPO's preference model resizes the decoded images before it clamps them: give it them unclamped.
            unclamped = isinstance(self.step_scorer, StepAwarePreferenceModel)

            def score(clean: torch.Tensor, step_index: torch.Tensor) -> torch.Tensor:
                with policy.unclamped_decode() if unclamped else contextlib.nullcontext():
                    images = policy.decode(clean)
                timesteps = self._score_timesteps(step_index)
                scores = torch.as_tensor(self.step_scorer(list(prompts) * k, images, timesteps), device=clean.device)
                if scores.shape != (clean.shape[0],):
                    raise ValueError(
                        f"step_scorer returned shape {tuple(scores.shape)} for {clean.shape[0]} candidates; it must "
                        "return one score per image, shape (n,)"
                    )
                return scores.float()

            result = pooled_rollout(
                policy, model, latents, cond, noise.to(latents.device), self.pool_steps, k, choices, score
            )
            result["images"] = policy.decode(policy.final_latents(result["final_latents"], cond))
        result["choices"] = choices.T.to(latents.device)
        return result

    def _score_timesteps(self, step_index: torch.Tensor) -> torch.Tensor:
        """The model timestep of each candidate's x̂0 prediction; 0 for clean samples (index N)."""
        last = step_index >= self.policy.num_steps
        timesteps = self.policy.process.model_timestep(step_index.clamp_max(self.policy.num_steps - 1))
        return torch.where(last, torch.zeros_like(timesteps), timesteps)

    def _plan_round(self, rollout: dict[str, torch.Tensor], plan: RolloutPlan, advantages: torch.Tensor) -> list:
        """Each pool's best and worst candidate, kept above the threshold; micro-batches of (chain, pool) pairs, a
        fresh shuffle per iteration."""
        args = self.args
        scores = rollout["scores"]  # (B, S, k)
        best, worst = scores.argmax(dim=2), scores.argmin(dim=2)
        gap = scores.max(dim=2).values - scores.min(dim=2).values
        scale = args.score_scale
        if scale is None:  # SPO's preference model: its own logits; any other scorer: the round's mean gap
            own_logits = isinstance(self.step_scorer, StepAwarePreferenceModel)  # the same on every process
            scale = 1.0 if own_logits else 1 / self.accelerator.gather(gap.flatten()).mean().clamp_min(1e-30)
        keep = torch.tanh(scale * gap / 2) > args.pair_threshold  # SPO's softmax gap of the two
        self.training_signal.add_items(keep.sum())
        chains, pools = scores.shape[:2]
        chain, pool = torch.arange(chains, device=scores.device)[:, None], torch.arange(pools, device=scores.device)
        candidates = rollout["candidates"]  # (B, S, k, ...)
        self._rollout |= {
            "x_t": rollout["latents"],
            "chosen": candidates[chain, pool, best],
            "rejected": candidates[chain, pool, worst],
            "keep": keep,
            "score_gap": gap,
        }
        items, dropped = [], ~keep.flatten().cpu()  # read once per round
        for _ in range(args.num_iterations):
            order = torch.randperm(chains * pools, generator=self._cpu_generator)
            order = order[dropped[order].argsort(stable=True)]  # kept pairs first, in random order
            items.extend(order.split(args.per_device_train_batch_size))
        return items

    def _microbatch(self, pairs: torch.Tensor) -> dict[str, Any]:
        rollout, device = self._rollout, self.accelerator.device
        pools = rollout["x_t"].shape[1]
        pairs = pairs.to(device)
        chain, pool = pairs // pools, pairs % pools
        steps = torch.tensor(self.pool_steps, device=device)
        return {
            "latents": rollout["x_t"][chain, pool],
            "chosen": rollout["chosen"][chain, pool],
            "rejected": rollout["rejected"][chain, pool],
            "step_index": steps[pool],
            "keep": rollout["keep"][chain, pool].float(),
            "score_gap": rollout["score_gap"][chain, pool],
            "cond": self._round_cond(chain),
        }

    # ----------------------------------------------------------------------------------------------------------
    # Loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        policy, args = self.policy, self.args
        latents, step_index, cond, keep = inputs["latents"], inputs["step_index"], inputs["cond"], inputs["keep"]
        output = policy.predict(model, latents, cond, at=step_index)  # x_w and x_l share x_t: one prediction
        reference = self.reference_prediction(model, latents, cond, step_index)
        log_ratios = []
        for side in ("chosen", "rejected"):
            log_prob = policy.step(output, latents, step_index, prev_sample=inputs[side]).log_prob
            ref_log_prob = policy.step(reference, latents, step_index, prev_sample=inputs[side]).log_prob
            log_ratios.append(log_prob - ref_log_prob)
        losses, chosen, rejected = spo_loss(*log_ratios, args.beta, args.epsilon)
        # Dropped pairs train nothing and kept ones are not reweighted by how many share the micro-batch.
        loss = torch.where(keep > 0, losses, 0.0).sum() / len(keep)
        with torch.no_grad():
            self._record("pairs/kept", keep)
            self._record("pairs/score_gap", inputs["score_gap"])
            self._record("log_ratio/chosen", log_ratios[0])
            self._record("log_ratio/rejected", log_ratios[1])
            self._record("rewards/margins", args.beta * (chosen - rejected))
            self._record("rewards/accuracies", (log_ratios[0] > log_ratios[1]).float())
        return (loss, output) if return_outputs else loss

    def _model_card_details(self) -> dict[str, str]:
        args = self.args
        return super()._model_card_details() | {
            "sampling": f"{args.num_inference_steps} steps, {args.sde_type} noise level {args.eta}, guidance "
            f"{args.guidance_scale}, {self._sample_size()}",
            "SPO": f"pools of {args.pool_size} from step {args.pool_start_step}, pair threshold {args.pair_threshold} "
            f"(score scale {'1 / mean gap' if args.score_scale is None else f'{args.score_scale:g}'}), β {args.beta:g}, "
            f"ratio clip {args.epsilon}",
        }


__all__ = ["RewardStepScorer", "SPOTrainer"]
