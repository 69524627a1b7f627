"""Direct reward backpropagation: SRPO's Direct-Align and DRaFT-K / AlignProp on the online engine.

A round samples images from known noise ε (the deterministic sampler, or SRPO's SDE with ``eta``; no gradients; their
rewards are logged); each training item then backpropagates a differentiable reward through the VAE decoder into one
model step (Direct-Align) or the sampler's last K steps (DRaFT). Rewards must expose ``score(prompts, images) -> Tensor`` with
the graph kept (every model reward here, and ``brightness``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..direct_align import direct_align_levels, draw_positions, semantic_relative_reward, shifted_sigmas
from ..rewards import reward_name
from ..sampling import RolloutPlan, ode_step
from .direct_reward_config import DirectRewardConfig
from .evaluation import policy_with
from .rollout_trainer import RolloutTrainer

logger = logging.getLogger(__name__)

TABLE = 1000  # entries of SRPO's σ table (its `timestep_length`)
# SRPO's published reward scales (its CLIP-family rewards divide logit_scale·cos by 20, "comparable with hps").
PUBLISHED_SCALES = {"hpsv2": 1.0, "pickscore": 1 / 20, "clip_score": 1 / 20, "brightness": 1.0}
DERIVED_SPREAD = 0.02  # a derived scale puts the first round's reward spread at HPS v2.1's


class DirectRewardTrainer(RolloutTrainer):
    """Reward-gradient fine-tuning: SRPO's Direct-Align (arXiv 2509.06942) and DRaFT-K (arXiv 2309.17400) / AlignProp
    (arXiv 2310.03739), for flow-matching (FLUX, SD3, Wan) and ε/v-prediction (SD1.x/2.x, SDXL) pipelines; for the
    latter a noise level s ∈ [0, 1] of Direct-Align's table is the timestep s·(T_train − 1). Constructor as
    :class:`~trl_dance.DanceGRPOTrainer`'s; ``reward_funcs`` must be differentiable rewards."""

    _tag_names = ["trl", "trl-dance", "srpo", "direct-align", "diffusers"]
    _name = "DirectReward"
    _paper = {
        "title": "Directly Aligning the Full Diffusion Trajectory with Fine-Grained Human Preference",
        "id": "2509.06942",
        "citation": "@article{shen2025srpo,\n  title={Directly Aligning the Full Diffusion Trajectory with Fine-Grained "
        "Human Preference},\n  author={Shen, Xiangwei and others},\n  journal={arXiv preprint arXiv:2509.06942},\n"
        "  year={2025}\n}",
    }
    config_class = DirectRewardConfig
    _synchronous_reason = "DirectRewardTrainer back-propagates the reward through the round's sampling, which must be the trained weights"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        plain = [reward_name(f) for f in self.reward_funcs if not callable(getattr(f, "score", None))]
        if plain:
            raise ValueError(
                f"DirectRewardTrainer backpropagates through the reward; {plain} only return floats. Use a reward "
                "with a differentiable score(prompts, images) -> Tensor (the model rewards here, brightness)"
            )
        args = self.args
        grid = shifted_sigmas(args.direct_align_grid_steps, args.shift)
        low, high = args.direct_align_window
        self._window = torch.linspace(float(grid[low]), float(grid[high]), TABLE)
        self._discount = {
            False: torch.linspace(*args.discount_pos, TABLE),  # denoise branch
            True: torch.linspace(*args.discount_inv, TABLE),  # inversion branch
        }
        self._noise_parts: list[torch.Tensor] = []
        # Per reward: (scale, offset) of the loss's reward, s·(f − offset); derived ones are set at the first round.
        scales = args.reward_scales or [PUBLISHED_SCALES.get(name) for name in self.reward_names]
        if len(scales) != len(self.reward_funcs):
            raise ValueError(f"{len(scales)} reward_scales for {len(self.reward_funcs)} reward functions")
        self._reward_affine: list[tuple[float, float] | None] = [None if v is None else (v, 0.0) for v in scales]
        self._train_policy = policy_with(self.policy, guidance_scale=args.train_guidance_scale or args.guidance_scale)
        framewise = [reward_name(f) for f in self.reward_funcs if not getattr(f, "accepts_video", False)]
        if self.policy.is_video and framewise:  # (the loss back-propagates each reward's score of the whole sample)
            raise ValueError(
                f"{type(self.policy.pipeline).__name__} generates videos; Direct-Align/DRaFT differentiate each reward "
                f"through the decoded sample, and {framewise} score images (a reward for videos sets "
                "accepts_video = True and takes (B, F, 3, H, W))"
            )
        self._srp: list[bool] | None = None  # per reward: the semantic-relative preference applies (first round)
        vae = self.policy.pipeline.vae
        if args.decoder_checkpointing:  # diffusers' own, per decoder block: the peak is one block's activations
            if vae._supports_gradient_checkpointing:
                vae.enable_gradient_checkpointing()
            else:  # (Wan's and some other video VAEs in diffusers 0.42)
                logger.warning(
                    f"decoder_checkpointing: diffusers' {type(vae).__name__} has no gradient checkpointing; the "
                    "decoder keeps its activations for the backward pass"
                )

    _trains_on_advantages = False  # the loss takes reward gradients

    def _advantages(self, all_rewards: torch.Tensor, total: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        for column, affine in enumerate(self._reward_affine):  # gathered: every process derives the same
            if affine is None:
                values = all_rewards[:, column]
                values = values[values.isfinite()]
                spread = values.std().item() if len(values) > 1 else 0.0
                if not spread > 0:
                    raise ValueError(
                        f"cannot derive a loss scale for reward {self.reward_names[column]!r}: its first round's "
                        f"{len(values)} rewards have no spread; set reward_scales"
                    )
                self._reward_affine[column] = (DERIVED_SPREAD / spread, values.mean().item())
        return torch.zeros_like(total)  # the loss takes reward gradients, not advantages

    @torch.no_grad()
    def _reads_prompt(self, func, images: torch.Tensor) -> bool:
        """Whether a reward's score depends on the control words (on a few of the first round's images): for one that
        ignores its prompt, SRP's (1 + k)·r(c⁺. p) − r(c⁻. p) is just k·r, a 4–100× weaker signal, so it trains on
        the reward itself (with a warning)."""
        prompts, images = self._rollout["prompts"][:2], images[:2]
        args = self.args
        positive = checked_score(func, [f"{args.positive_words[0]}. {p}" for p in prompts], images)
        negative = checked_score(func, [f"{args.negative_words[0]}. {p}" for p in prompts], images)
        if torch.equal(positive, negative):
            logger.warning(
                f"reward {reward_name(func)!r} ignores its prompt: the semantic-relative preference would reduce it to "
                "k·r; it is trained on the reward itself (srp applies to text-conditioned rewards)"
            )
            return False
        return True

    def _signal_items(self, advantages: torch.Tensor) -> None:
        return None  # counted per micro-batch: the items whose hinge is active

    def _idle_causes(self) -> tuple[str, str]:
        return (
            f"the hinge ReLU({self.args.reward_margin} − r) was inactive on every item (rewards above reward_margin): "
            f"lower reward_scales (now {[a and round(a[0], 6) for a in self._reward_affine]}) or raise reward_margin",
            "the reward's gradient was exactly zero in every update: its score() must be differentiable in the "
            "images (no rounding or thresholding of pixels)",
        )

    # ----------------------------------------------------------------------------------------------------------
    # Rounds: samples from known noise

    def rollout_plan(self, round_index: int | None = None) -> RolloutPlan:
        steps = self.policy.num_steps
        return RolloutPlan(steps) if self.args.eta > 0 else RolloutPlan.deterministic(steps)

    def _initial_noise(
        self, generators: list[torch.Generator], first_index: int, round_index: int | None = None
    ) -> torch.Tensor:
        noise = super()._initial_noise(generators, first_index, round_index)
        self._noise_parts.append(noise)  # ε, which Direct-Align re-noises with
        return noise

    def _plan_round(self, rollout: dict[str, torch.Tensor], plan: RolloutPlan, advantages: torch.Tensor) -> list:
        """Items (sample, branch, table position): per sample a denoise item and, with ``inversion``, an inversion item
        at the same position (Direct-Align), or one item (DRaFT); micro-batches in a fresh order each iteration."""
        args = self.args
        self._rollout |= {"x0": rollout["final_latents"], "noise": torch.cat(self._noise_parts)}
        if self._srp is None:
            self._srp = [args.srp and self._reads_prompt(func, rollout["images"]) for func in self.reward_funcs]
        self._noise_parts = []
        samples = len(advantages)
        branches = 2 if args.method == "direct_align" and args.inversion else 1
        items = []
        for _ in range(args.num_iterations):
            order = torch.randperm(samples, generator=self._cpu_generator)
            mid = draw_positions(samples, self._cpu_generator, TABLE)
            sample = order.repeat_interleave(branches)
            inversion = torch.tensor([bool(b) for b in range(branches)] * samples)
            position = mid[order].repeat_interleave(branches)
            size = args.per_device_train_batch_size
            items.extend(zip(sample.split(size), inversion.split(size), position.split(size)))
        return items

    def _microbatch(self, item) -> dict[str, Any]:
        rollout, device = self._rollout, self.accelerator.device
        samples, inversion, position = item
        index = samples.to(device)
        k = self.args.draft_k
        if self.args.draft_random_truncation:
            k = int(torch.randint(1, k + 1, (1,), generator=self._cpu_generator))
        return {
            "x0": rollout["x0"][index],
            "noise": rollout["noise"][index],
            "prompts": [rollout["prompts"][i] for i in samples.tolist()],
            "cond": self._round_cond(index),
            "inversion": inversion,
            "position": position,
            "draft_k": k,
        }

    # ----------------------------------------------------------------------------------------------------------
    # Loss

    def clean_latents(self, model, latents: torch.Tensor, noise: torch.Tensor, level_from, level_to, cond):
        """Direct-Align's x̂0 (B, ...) from ``latents`` at noise level ``level_from`` (B,): one deterministic model step
        to ``level_to`` (B,) (flow: Euler; VP: DDIM η = 0), then the clean latents recovered with the known ε;
        differentiable in the model (and ``latents``)."""
        policy = self._train_policy
        output, process = policy.predict(model, latents, cond, at=level_from), policy.process
        return process.recover_clean(
            process.deterministic_step(output, latents, level_from, level_to), noise, level_to
        )

    def draft_latents(self, model, noise: torch.Tensor, cond, k: int) -> torch.Tensor:
        """DRaFT-K: the sampler's first N − K deterministic steps without gradients from ε, its last K with (each
        step checkpointed with ``decoder_checkpointing``); the clean latents (B, ...)."""
        policy = self._train_policy
        steps, latents = policy.num_steps, noise
        with torch.no_grad():
            for i in range(steps - k):
                latents = ode_step(policy, model, latents, i, cond)
        for i in range(steps - k, steps):
            step = lambda x, i=i: ode_step(policy, model, x, i, cond)  # noqa: E731
            latents = (
                checkpoint(step, latents, use_reentrant=False) if self.args.decoder_checkpointing else step(latents)
            )
        return latents

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] with the graph kept (with ``decoder_checkpointing`` each decoder block is
        recomputed in the backward pass)."""
        return self.policy.decode(latents)

    def item_rewards(
        self, images: torch.Tensor, prompts: list[str], inversion: torch.Tensor, position
    ) -> torch.Tensor:
        """(B,) the weighted differentiable reward of each item, each reward f as s·(f − offset) (the reward scales):
        SRPO's semantic-relative preference (control words swapped on the inversion branch), or the reward itself
        (negated on the inversion branch)."""
        args, step = self.args, self.state.global_step
        sign = 1 - 2 * inversion.to(images.device, torch.float32)  # +1 denoise, −1 inversion
        total = torch.zeros(len(prompts), device=images.device, dtype=images.dtype)
        weights = self.reward_weights.tolist()
        for column, (func, weight, (scale, offset)) in enumerate(zip(self.reward_funcs, weights, self._reward_affine)):
            func = functools.partial(_affine_score, func, scale, offset)
            if args.srp if self._srp is None else self._srp[column]:
                positive = args.positive_words[step % len(args.positive_words)]
                negative = args.negative_words[step % len(args.negative_words)]
                discount = torch.where(inversion, self._discount[True][position], self._discount[False][position]).to(
                    images.device
                )
                value = semantic_relative_reward(func, prompts, images, positive, negative, discount, inversion)
            else:
                value = sign * func(prompts, images)
            total = total + weight * value.to(total.dtype)
        return total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, device = self.args, self.accelerator.device
        x0, noise, cond = inputs["x0"], inputs["noise"], inputs["cond"]
        if args.method == "draft":
            latents = self.draft_latents(model, noise, cond, inputs["draft_k"])
            reward = self.item_rewards(self.decode(latents), inputs["prompts"], inputs["inversion"], None)
            loss = -reward.mean()
            self.training_signal.add_items(len(reward))
            self._record("draft/k", torch.tensor([float(inputs["draft_k"])], device=device))
        else:
            sigma_from, sigma_to, m = direct_align_levels(
                inputs["position"], inputs["inversion"], self._window, int((1 - args.groundtruth_ratio) * TABLE) + 1
            )
            sigma_from, sigma_to = sigma_from.to(device), sigma_to.to(device)
            latents = self.policy.process.add_noise(
                x0, noise, sigma_from
            )  # the clean latents re-noised with their own ε
            clean = self.clean_latents(model, latents, noise, sigma_from, sigma_to, cond)
            reward = self.item_rewards(self.decode(clean), inputs["prompts"], inputs["inversion"], m)
            loss = torch.relu(args.reward_margin - reward).mean()
            active = (reward.detach() < args.reward_margin).float()
            self.training_signal.add_items(active.sum())
            self._record("direct_align/hinge_active", active)
            self._record("direct_align/sigma", sigma_from)
        self._record("direct_reward/reward", reward.detach())
        return (loss, reward) if return_outputs else loss

    def _model_card_details(self) -> dict[str, str]:
        args = self.args
        if args.method == "draft":
            k = f"K ≤ {args.draft_k} (random truncation)" if args.draft_random_truncation else f"K = {args.draft_k}"
            method = f"DRaFT through the last {k} of {args.num_inference_steps} steps"
        else:
            low, high = args.direct_align_window
            method = (
                f"Direct-Align, σ from entries {low}–{high} of a {args.direct_align_grid_steps}-step schedule (shift "
                f"{args.shift}), inversion branch {'on' if args.inversion else 'off'}, SRP {'on' if args.srp else 'off'}"
            )
        return super()._model_card_details() | {"method": method}

    def _resume_state(self) -> dict[str, Any]:
        return super()._resume_state() | {"reward_affine": self._reward_affine, "srp": self._srp}

    def _restore_resume_state(self, state: dict[str, Any]) -> None:
        super()._restore_resume_state(state)
        self._reward_affine = state.get("reward_affine", self._reward_affine)
        self._srp = state.get("srp", self._srp)


def checked_score(func, prompts: list[str], images: torch.Tensor) -> torch.Tensor:
    """``func.score(prompts, images)``, checked: a floating (B,) tensor on the images' device that carries the images'
    gradient (when they have one).

    Raises:
        ValueError naming the reward and what is wrong, before autograd or a shape mismatch would say it unnamed.
    """
    values, name, batch = func.score(prompts, images), reward_name(func), images.shape[0]
    where = f"reward {name!r}: score(prompts, images) must return a (B,) = ({batch},) floating tensor"
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{where}, got {type(values).__name__} (a list or floats carry no gradient)")
    if values.shape != (batch,) or not values.is_floating_point():
        raise ValueError(f"{where}, got {values.dtype} of shape {tuple(values.shape)}")
    if images.requires_grad and not values.requires_grad:
        raise ValueError(
            f"{where} differentiable in the images; it does not require grad (a .detach(), torch.no_grad(), .item() or "
            "a round trip through numpy/PIL inside score cuts the gradient)"
        )
    return values


def _affine_score(func, scale: float, offset: float, prompts: list[str], images: torch.Tensor) -> torch.Tensor:
    return scale * (checked_score(func, prompts, images) - offset)


__all__ = ["DirectRewardTrainer"]
