"""Configuration of :class:`~trl_dance.DirectRewardTrainer`."""

import math
from dataclasses import dataclass, field
from typing import Any

from ..direct_align import NEGATIVE_CONTROL_WORDS, POSITIVE_CONTROL_WORDS
from .rollout_config import RolloutConfig, _choice

METHODS = ("direct_align", "draft")


@dataclass
class DirectRewardConfig(RolloutConfig):
    r"""
    Configuration for [`DirectRewardTrainer`]: training on the gradient of a differentiable reward.

    Each round the policy samples `generation_batch_size` images from known noise ε (the deterministic sampler, or
    with `eta` > 0 DanceGRPO's SDE as SRPO samples; their rewards are logged as `reward`, `rewards/<name>/mean`); then
    each sample gives training items whose loss
    backpropagates a reward through the VAE decoder into the denoiser. Generation, reward and model fields:
    [`~trl_dance.trainer.rollout_config.RolloutConfig`] (`num_generations` may be 1: no groups are formed).
    Defaults follow SRPO's FLUX.1-dev recipe (lr 5e-6, grad-norm clip 0.1, weight decay 1e-4, 25 deterministic rollout
    steps with shift 3 at guidance 1); SRPO trains the Direct-Align forwards at FLUX's guidance 3.5, which
    `srpo_flux.yaml` sets with `train_guidance_scale` (a default of 3.5 would turn CFG on for SD models).

    Reward scales. The loss sees each reward times a scale (`reward_scales`): SRPO's own for the rewards it
    publishes (`hpsv2` 1, its cosine; `pickscore` and `clip_score` 1/20, "to make the score scope comparable with
    HPS"; `brightness` 1, already in [0, 1]); every other reward f is centred and scaled by its first round's rollout
    statistics, s·(f − μ₀) with s = 0.02/σ₀ (HPS v2.1's spread over FLUX samples), so the hinge ReLU(0.7 − r) stays
    active and the learning rate means the same whatever the reward's units. The metric
    `direct_align/hinge_active` is the fraction of items with a gradient; a round without any is reported (see
    `max_idle_rounds`).

    Parameters:
        eta (`float`, defaults to `0.0`): Noise level of the rollouts' SDE (DanceGRPO's; DDIM η for ε models) on all
            but the last step; 0: the deterministic sampler, which is what SRPO's released code samples with (its
            scripts pass η 0.3, which its `flux_step` ignores). Direct-Align re-noises the sample with its initial ε
            either way; DRaFT reruns the deterministic sampler.
        train_guidance_scale (`float` or `None`, defaults to `None`): The guidance of the forwards with gradients
            (Direct-Align's step, DRaFT's rerun steps); `None`: `guidance_scale`. SRPO rolls out at guidance 1 and
            trains FLUX's guidance embedding at 3.5.
        reward_scales (`list[float]` or `None`, defaults to `None`): One multiplier per reward for the loss; `None`:
            automatic, see "Reward scales" above.
        method (`str`, defaults to `"direct_align"`): `"direct_align"` (SRPO): the sample re-noised with its own ε to
            σ_from, one model step with gradients to σ_to, x̂0 = (x_σto − σ_to·ε)/(1 − σ_to), loss ReLU(margin − r)
            (ε/v-prediction models: a DDIM step between the timesteps σ·(T_train − 1), x̂0 = (x_t − √(1 − ᾱ)·ε)/√ᾱ);
            `"draft"` (DRaFT-K / AlignProp): the sampler's steps rerun from ε, the last K with gradients, loss −r.
        direct_align_grid_steps (`int`, defaults to `50`) and direct_align_window (`list[int]`, defaults to
            `[5, 25]`): σ is drawn from a 1000-entry table between the shifted `direct_align_grid_steps`-step
            schedule's entries `direct_align_window` (SRPO's `train_timestep`: σ > 0.99 distorts structure, late σ
            hacks colour).
        groundtruth_ratio (`float`, defaults to `0.9`): the step length is (1 − ratio)·1000 + 1 table entries.
        inversion (`bool`, defaults to `True`): Each sample also trains SRPO's inversion branch (a step toward more
            noise, control words swapped): two items per sample, adjacent in the round's order (SRPO accumulates
            both into one update).
        srp (`bool`, defaults to `True`): The semantic-relative preference (1 + k)·r(c⁺. p) − r(c⁻. p) with control
            words cycled by optimizer step; off: the reward itself (negated on the inversion branch).
        positive_words, negative_words (`list[str]`): the control words c⁺, c⁻ (SRPO's).
        discount_pos (`list[float]`, defaults to `[0.1, 0.25]`), discount_inv (`[0.3, 0.01]`): k along the table, on
            the denoise and inversion branches.
        reward_margin (`float`, defaults to `0.7`): ReFL's threshold of the ReLU loss.
        draft_k (`int`, defaults to `1`): DRaFT's K, the steps backpropagated through (K = 1: DRaFT-LV without its
            re-noising).
        draft_random_truncation (`bool`, defaults to `False`): AlignProp's truncation: K drawn uniformly from
            [1, `draft_k`] for each micro-batch.
        decoder_checkpointing (`bool`, defaults to `True`): diffusers' gradient checkpointing of the VAE (each decoder
            block recomputed in the backward pass: FLUX's decoder at 1024² in bf16 keeps 1.6 GiB for backward instead
            of 13.3 GiB, see `benchmarks/direct_reward_memory.py`); `draft` also checkpoints each denoiser step.
    """

    min_generations = 1

    learning_rate: float = field(default=5e-6, metadata={"help": "AdamW learning rate (SRPO: 5e-6)."})
    max_grad_norm: float = field(default=0.1, metadata={"help": "Gradient-norm clip (SRPO: 0.1)."})
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay (SRPO: 1e-4)."})
    num_generations: int = field(default=1, metadata={"help": "Samples per prompt (no groups are needed)."})
    num_inference_steps: int = field(default=25, metadata={"help": "Rollout steps (SRPO: 25)."})
    guidance_scale: float = field(default=1.0, metadata={"help": "Guidance of rollouts and training (SRPO: 1)."})
    scale_rewards: str = field(default="none", metadata={"help": "Unused: the loss takes rewards, not advantages."})
    share_initial_noise: str = field(default="none", metadata={"help": "Every sample its own noise ε."})
    per_device_train_batch_size: int = field(default=2, metadata={"help": "Training items per micro-batch."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer update."})

    eta: float = field(default=0.0, metadata={"help": "Rollout SDE noise level (0: deterministic, as SRPO's code)."})
    train_guidance_scale: float | None = field(
        default=None, metadata={"help": "Guidance of the forwards with gradients (None: guidance_scale; SRPO 3.5)."}
    )
    reward_scales: list[float] | None = field(
        default=None, metadata={"help": "Loss multiplier of each reward (None: SRPO's, or from the first round)."}
    )
    method: str = field(default="direct_align", metadata={"help": "direct_align | draft.", "choices": list(METHODS)})
    direct_align_grid_steps: int = field(default=50, metadata={"help": "Steps of the schedule σ is drawn from."})
    direct_align_window: list[int] = field(
        default_factory=lambda: [5, 25], metadata={"help": "Schedule entries bounding the trained σ."}
    )
    groundtruth_ratio: float = field(default=0.9, metadata={"help": "Step length: (1 − ratio)·1000 + 1 entries."})
    inversion: bool = field(default=True, metadata={"help": "Also train SRPO's inversion branch."})
    srp: bool = field(default=True, metadata={"help": "Semantic-relative preference with control words."})
    positive_words: list[str] = field(
        default_factory=lambda: list(POSITIVE_CONTROL_WORDS), metadata={"help": "Positive control words."}
    )
    negative_words: list[str] = field(
        default_factory=lambda: list(NEGATIVE_CONTROL_WORDS), metadata={"help": "Negative control words."}
    )
    discount_pos: list[float] = field(default_factory=lambda: [0.1, 0.25], metadata={"help": "k, denoise branch."})
    discount_inv: list[float] = field(default_factory=lambda: [0.3, 0.01], metadata={"help": "k, inversion branch."})
    reward_margin: float = field(default=0.7, metadata={"help": "ReLU(margin − r) threshold."})
    draft_k: int = field(default=1, metadata={"help": "DRaFT's K: sampler steps backpropagated through."})
    draft_random_truncation: bool = field(default=False, metadata={"help": "AlignProp: K ~ U[1, draft_k]."})
    decoder_checkpointing: bool = field(default=True, metadata={"help": "Recompute the VAE decoder in backward."})

    def _check_method(self) -> None:
        _choice("method", self.method, METHODS)
        low, high = (self.direct_align_window + [None, None])[:2]
        if len(self.direct_align_window) != 2 or not 0 <= low < high <= self.direct_align_grid_steps:
            raise ValueError(
                f"direct_align_window must be two schedule entries 0 <= a < b <= direct_align_grid_steps "
                f"({self.direct_align_grid_steps}), got {self.direct_align_window}"
            )
        if not 0 <= self.groundtruth_ratio < 1:
            raise ValueError(f"groundtruth_ratio must be in [0, 1), got {self.groundtruth_ratio}")
        for name in ("discount_pos", "discount_inv"):
            if len(getattr(self, name)) != 2:
                raise ValueError(f"{name} must be [start, end], got {getattr(self, name)}")
        if self.srp and (not self.positive_words or not self.negative_words):
            raise ValueError("srp needs positive_words and negative_words")
        if not 1 <= self.draft_k <= self.num_inference_steps:
            raise ValueError(f"draft_k must be in [1, num_inference_steps], got {self.draft_k}")
        if not (self.eta >= 0 and math.isfinite(self.eta)):
            raise ValueError(f"eta must be >= 0, got {self.eta}")
        if self.reward_scales is not None and not all(math.isfinite(v) and v > 0 for v in self.reward_scales):
            raise ValueError(f"reward_scales must be positive numbers, one per reward, got {self.reward_scales}")
        if not math.isfinite(self.reward_margin):
            raise ValueError(f"reward_margin must be finite, got {self.reward_margin}")

    def sde_settings(self) -> dict[str, Any]:
        return {"eta": self.eta}  # SRPO's rollouts: DanceGRPO's SDE at eta (0: the deterministic sampler)

    def _round_items(self) -> tuple[int, str]:
        samples = self.per_device_generation_batch_size
        branches = 2 if self.method == "direct_align" and self.inversion else 1
        return samples * branches, f"{samples} samples × {branches} branch(es) = {samples * branches} items"
