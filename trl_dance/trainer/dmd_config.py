"""Configuration of :class:`~trl_dance.DMDTrainer`."""

import math
from dataclasses import dataclass, field
from typing import Any

from .evaluation import STOCHASTIC_SAMPLING_SDE
from .rollout_config import RolloutConfig

LOSS_TYPES = ["dmd", "ac_dmd", "rtdmd"]


@dataclass
class DMDConfig(RolloutConfig):
    r"""
    Configuration for [`DMDTrainer`]: DMD2 distribution-matching distillation of a few-step student on flow-matching
    models (arXiv 2405.14867; its flow ports in verl-omni and Flow-Factory, ALGORITHMS-NEXT §2.17.1), with RTDMD's
    reward tilt (arXiv 2605.26108) as an option.

    The student (the trained LoRA, or the denoiser) samples each round's prompts deterministically on the few-step σ
    grid (`num_inference_steps`, the `"dance"` grid with `shift` 3: σ = 1, 0.9, 0.75, 0.5 at 4 steps, verl-omni's),
    recording every state it visits; it is trained on its own intermediate states (backward simulation). The teacher
    ("real score") is the base model (LoRA disabled; a frozen copy for full fine-tuning) with `teacher_guidance_scale`;
    the fake score is a second copy of the trained tensors with its own AdamW. Each round: `fake_score_updates`
    fake-score updates (flow matching on the round's detached student samples), then one student update (DMD's
    generator loss). Defaults: verl-omni's Qwen-Image recipe (student lr 1e-4, fake lr 2e-5, 2 fake updates per
    student update, teacher CFG 4, σ ~ U[0.02, 0.98]). Generation, reward and model fields:
    [`~trl_dance.trainer.rollout_config.RolloutConfig`]; the rewards only monitor unless `reward_tilt` > 0.

    Units. One training item per sample per round: the sample's state at one of its steps drawn uniformly (`"rtdmd"`:
    its last step, plus one item per PPO step). A round has `items / processes / per_device_train_batch_size`
    micro-batches, all accumulated into the student's one update.

    Parameters:
        teacher_model_name_or_path (`str` or `None`, defaults to `None`): a teacher from another checkpoint (a Hub id
            or pipeline folder of the same family, of which only the denoiser loads; TRL's GKD name): the student is
            the trained model, and the teacher and the fake score start from this checkpoint (RTDMD's FLUX.2 [klein]:
            the distilled student, the base teacher). `None`: the trained model's base is the teacher. The
            `DMDTrainer(teacher_model=...)` argument takes a denoiser or pipeline instance too.
        teacher_guidance_scale (`float`, defaults to `4.0`): the teacher's CFG scale (FLUX: its guidance-embedding
            value), applied in the teacher's forwards only; the student and the fake score use `guidance_scale` (1:
            none, DMD's students are CFG-free).
        fake_score_updates (`int`, defaults to `2`): fake-score updates per student update (the two time-scale rule;
            DMD2: 10 for SD1.5, 5 for SDXL; verl-omni: 2). Each draws a fresh step, noise level and noise per sample.
        fake_score_learning_rate (`float`, defaults to `2e-5`): the fake score's AdamW learning rate (its betas,
            epsilon, weight decay and gradient clip are the student's).
        dmd_sigma_min, dmd_sigma_max (`float`, defaults to `0.02`, `0.98`): the noise levels σ ~ U[min, max] at which
            the teacher and the fake score judge the student's samples (the student's loss), and, unless the next two
            are set, at which the fake score learns them.
        fake_score_sigma_min, fake_score_sigma_max (`float` or `None`, defaults to `None`): the noise levels of the
            fake score's own loss (flow matching on the student's samples; AC-DMD's re-noising above σ_s). `None`: the
            DMD range above, as the flow ports (verl-omni, Flow-Factory) draw it; DMD2's own recipes train the fake
            score on the full range (its t ~ U[0, 1000)): `0.0` and `1.0`.
        reward_tilt (`float`, defaults to `0.0`): RTDMD's reward term: the student's loss subtracts `reward_tilt` ×
            the weighted sum of the rewards of its decoded clean sample, differentiated through the VAE decoder (the
            rewards must have a differentiable `score`, as `DirectRewardTrainer`'s). 0: plain DMD.
        reward_tilt_margin (`float` or `None`, defaults to `None`): RTDMD's hinge: the reward term becomes
            `reward_tilt` × relu(margin − reward), so a sample whose weighted reward is above the margin gets no reward
            gradient (RTDMD: 3, on PickScore + CLIPScore + HPSv2 at weight 1 each). `None`: the linear term.
        loss_type (`str`, defaults to `"dmd"`): `"dmd"` (DMD2: the student is judged at its clean sample x_g),
            `"ac_dmd"` (RTDMD's stage 1, AC-DMD: the student takes its CPS transition from the recorded state to the
            next step's σ_s; that x_s is re-noised to σ_t ∈ (σ_s, `dmd_sigma_max`] along the sub-interval, and the
            teacher and the fake score each take one CPS step back to σ_s with the same noise; the fake score learns
            the ambient velocity of that re-noising, plus `consistency_weight` × its consistency term) or `"rtdmd"`
            (RTDMD's stage 2, its hybrid policy gradient: PPO on `policy_gradient_steps` of the stochastic CPS steps
            with group advantages of the rewards, plus, at the deterministic last step, `distribution_matching_weight`
            × DMD's loss and the reward tilt; the fake score trains as AC-DMD's at that step). With `"ac_dmd"` and
            `"rtdmd"` the student samples with CPS transitions (`cps_eta`), as RTDMD's does. At the last step (σ_s =
            0) the DMD losses are the same.
        distribution_matching_weight (`float` or `None`, defaults to `None`): the weight of DMD's generator loss in the
            student's loss. `None`: 1e-3 with `"rtdmd"` (RTDMD's stage 2, beside its policy gradient: at 1 the
            teacher's pull drowns the PPO term), 1 otherwise.
        scale_rewards (`str` or `None`, defaults to `None`): the advantages' statistics (RolloutConfig's). `None`:
            `"group"` with `"rtdmd"`, whose PPO term trains on them (raw reward differences, `"none"`, are ~1e-3 on
            a tiny model and let DMD's term dominate: the reward fell 67-109 first-round stds in 24 rounds, #76);
            `"none"` otherwise, where they only monitor.
        policy_gradient_steps (`int`, defaults to `2`): with `"rtdmd"`, the stochastic steps (of the first N − 1)
            trained by PPO each round, drawn per round from (`seed`, round), the same for every sample and process
            (RTDMD's "SubGRPO": 2 of the 3 of a 4-step student).
        epsilon (`float`, defaults to `1e-5`): with `"rtdmd"`, PPO's clip range (TRL's name; RTDMD's 1e-5).
        backward_simulation (`str`, defaults to `"ode"`): with `"dmd"`, how the student's few-step sampler moves
            between its steps, in its rollouts and its evaluation: `"ode"` (ours) the deterministic Euler step;
            `"renoise"` (DMD2's backward simulation, as Flow-Factory's) its clean prediction re-noised with fresh noise,
            x' = (1 − σ')·x̂₀ + σ'·ε: CPS at η = 1, and the sampler of diffusers'
            `FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)`, which a student trained this way needs.
        cps_eta (`float`, defaults to `0.9`): with `"ac_dmd"` and `"rtdmd"`, the CPS transitions' noise angle a (std
            = σ'·sin(aπ/2); RTDMD's η 0.9), in the student's sampler and in the teacher's and fake score's steps.
        consistency_weight (`float`, defaults to `0.01`): AC-DMD's consistency term in the fake score's loss
            (RTDMD's 0.01): the fake score's clean prediction at x_t against its predictions after two independent
            CPS moves of up to 0.2 in σ. 0: none (two fewer fake-score forwards per micro-batch).
        gan_generator_weight (`float`, defaults to `0.0`): DMD2's GAN term: a classifier head on the fake score's
            features at `gan_feature_block` learns to tell real images (the dataset's `dataset_image_field`) from
            the student's samples, both re-noised to σ ~ U[`dmd_sigma_min`, `dmd_sigma_max`], and the student's loss
            adds this weight × softplus(−D(x_g)). 0: no GAN. DMD2: 1e-3 (SD1.5), 5e-3 (SDXL), 3e-3 (ImageNet).
        gan_discriminator_weight (`float`, defaults to `1e-2`): the weight of the classifier's loss
            softplus(−D(real)) + softplus(D(fake)) in the fake score's loss (DMD2's); the head trains in the fake
            score's AdamW.
        gan_feature_block (`int` or `None`, defaults to `None`): the block whose input the head reads, in the
            denoiser's longest list of blocks of one class (negative from the end); `None`: the middle one (DMD2 reads
            the UNet's bottleneck).
        dataset_image_field (`str` or `None`, defaults to `None`): with the GAN, the dataset column of real images
            (videos for video models; paths, bytes, PIL images or `{"bytes", "path"}`, each resized to cover
            `height` × `width` and centre-cropped), captioned by the row's prompt. `None`: `image` (`video` for video
            models).
    """

    min_generations = 1  # the rewards only monitor: no group statistics enter the loss
    updates_per_round = 1

    # Overridden defaults (verl-omni's Qwen-Image DMD recipe).
    learning_rate: float = field(default=1e-4, metadata={"help": "The student's AdamW learning rate."})
    num_generations: int = field(default=1, metadata={"help": "Samples per prompt per round."})
    num_inference_steps: int = field(default=4, metadata={"help": "The student's steps."})
    guidance_scale: float = field(default=1.0, metadata={"help": "The student's guidance (1: CFG-free)."})
    scale_rewards: str | None = field(
        default=None,
        metadata={"help": "Advantage statistics (None: 'group' for rtdmd, else 'none': monitoring only)."},
    )

    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A teacher from another checkpoint (default: the trained model's base)."}
    )
    teacher_guidance_scale: float = field(default=4.0, metadata={"help": "The teacher's CFG scale."})
    fake_score_updates: int = field(default=2, metadata={"help": "Fake-score updates per student update."})
    fake_score_learning_rate: float = field(default=2e-5, metadata={"help": "The fake score's learning rate."})
    dmd_sigma_min: float = field(default=0.02, metadata={"help": "Lowest σ of the DMD and fake-score losses."})
    dmd_sigma_max: float = field(default=0.98, metadata={"help": "Highest σ of the DMD and fake-score losses."})
    fake_score_sigma_min: float | None = field(
        default=None, metadata={"help": "Lowest σ of the fake score's loss (None: dmd_sigma_min; DMD2's: 0)."}
    )
    fake_score_sigma_max: float | None = field(
        default=None, metadata={"help": "Highest σ of the fake score's loss (None: dmd_sigma_max; DMD2's: 1)."}
    )
    reward_tilt: float = field(default=0.0, metadata={"help": "RTDMD: weight of the differentiable reward term."})
    reward_tilt_margin: float | None = field(
        default=None, metadata={"help": "RTDMD's hinge relu(margin - reward) for the reward term (None: linear)."}
    )
    loss_type: str = field(
        default="dmd",
        metadata={
            "help": "'dmd' (DMD2), 'ac_dmd' (RTDMD's stage 1) or 'rtdmd' (its stage 2: PPO + DMD at the last step).",
            "choices": LOSS_TYPES,
        },
    )
    distribution_matching_weight: float | None = field(
        default=None, metadata={"help": "DMD's generator loss weight (None: 1e-3 for rtdmd, else 1)."}
    )
    policy_gradient_steps: int = field(default=2, metadata={"help": "rtdmd: CPS steps trained by PPO per round."})
    epsilon: float = field(default=1e-5, metadata={"help": "rtdmd: PPO clip range."})
    consistency_weight: float = field(default=0.01, metadata={"help": "AC-DMD's consistency term weight."})
    backward_simulation: str = field(
        default="ode",
        metadata={
            "help": "dmd: the student's sampler, 'ode' (deterministic) or 'renoise' (DMD2's: fresh noise each step).",
            "choices": ["ode", "renoise"],
        },
    )
    cps_eta: float = field(default=0.9, metadata={"help": "AC-DMD: the CPS transitions' noise angle."})
    gan_generator_weight: float = field(default=0.0, metadata={"help": "DMD2's GAN term in the student's loss."})
    gan_discriminator_weight: float = field(default=1e-2, metadata={"help": "The GAN classifier's loss weight."})
    gan_feature_block: int | None = field(default=None, metadata={"help": "Block the GAN head reads (the middle)."})
    dataset_image_field: str | None = field(
        default=None, metadata={"help": "With the GAN: the real images' column (default image, or video)."}
    )

    def __post_init__(self):
        # Defaults per loss type, resolved before RolloutConfig checks them (a default right for DMD's monitoring-only
        # advantages silently fails RTDMD's policy gradient).
        rtdmd = self.loss_type == "rtdmd"
        if self.scale_rewards is None:
            self.scale_rewards = "group" if rtdmd else "none"
        if self.distribution_matching_weight is None:
            self.distribution_matching_weight = 1e-3 if rtdmd else 1.0
        if self.fake_score_sigma_min is None:
            self.fake_score_sigma_min = self.dmd_sigma_min
        if self.fake_score_sigma_max is None:
            self.fake_score_sigma_max = self.dmd_sigma_max
        super().__post_init__()

    def _check_method(self) -> None:
        if self.num_iterations != 1:
            raise ValueError(
                f"DMD trains each round's samples once, after the round's fake-score updates: num_iterations must be 1, "
                f"got {self.num_iterations} (more student updates per round: a smaller gradient_accumulation_steps)"
            )
        if self.beta > 0:
            raise ValueError("DMD's student loss is the distribution matching to the teacher: beta > 0 does not apply")
        if self.fake_score_updates < 1:
            raise ValueError(f"fake_score_updates must be >= 1, got {self.fake_score_updates}")
        if not 0 < self.dmd_sigma_min < self.dmd_sigma_max <= 1:
            raise ValueError(
                f"need 0 < dmd_sigma_min < dmd_sigma_max <= 1, got {self.dmd_sigma_min}, {self.dmd_sigma_max}"
            )
        if not 0 <= self.fake_score_sigma_min < self.fake_score_sigma_max <= 1:
            raise ValueError(
                f"need 0 <= fake_score_sigma_min < fake_score_sigma_max <= 1, got {self.fake_score_sigma_min}, "
                f"{self.fake_score_sigma_max}"
            )
        for name in ("fake_score_learning_rate", "teacher_guidance_scale"):
            if not getattr(self, name) > 0 or not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.loss_type == "rtdmd":
            if self.num_generations < 2 and self.scale_rewards != "per_prompt":
                raise ValueError(
                    f"loss_type='rtdmd' trains by group advantages: num_generations must be >= 2 (or scale_rewards="
                    f"'per_prompt'), got {self.num_generations}"
                )
            if not 1 <= self.policy_gradient_steps <= self.num_inference_steps - 1:
                raise ValueError(
                    f"policy_gradient_steps must be in [1, {self.num_inference_steps - 1}] (the stochastic steps: the "
                    f"last, onto σ = 0, is deterministic), got {self.policy_gradient_steps}"
                )
            if not 0 < self.epsilon < 1:
                raise ValueError(f"epsilon must be in (0, 1), got {self.epsilon}")
            if self.per_device_generation_batch_size % self.per_device_train_batch_size:
                raise ValueError(
                    f"loss_type='rtdmd' trains its last-step items and its PPO items in micro-batches of one kind: "
                    f"per_device_train_batch_size ({self.per_device_train_batch_size}) must divide each process's "
                    f"{self.per_device_generation_batch_size} samples"
                )
        if self.reward_tilt_margin is not None and not math.isfinite(self.reward_tilt_margin):
            raise ValueError(f"reward_tilt_margin must be finite, got {self.reward_tilt_margin}")
        if not 0 < self.cps_eta <= 1:
            raise ValueError(f"cps_eta must be in (0, 1], got {self.cps_eta}")
        if self.backward_simulation not in ("ode", "renoise"):
            raise ValueError(f"backward_simulation must be 'ode' or 'renoise', got {self.backward_simulation!r}")
        if self.backward_simulation == "renoise" and self.loss_type != "dmd":
            raise ValueError(
                f"backward_simulation='renoise' is DMD2's sampler for loss_type='dmd'; {self.loss_type!r} samples "
                f"with CPS transitions at cps_eta ({self.cps_eta}): set cps_eta=1 for fresh noise at each step"
            )
        weights = ("reward_tilt", "gan_generator_weight", "gan_discriminator_weight", "consistency_weight")
        for name in (*weights, "distribution_matching_weight"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.gan_generator_weight > 0 and self.gan_discriminator_weight == 0:
            raise ValueError("gan_generator_weight > 0 needs a trained classifier: gan_discriminator_weight > 0")

    def sde_settings(self) -> dict[str, Any]:
        if self.loss_type == "dmd":
            return dict(STOCHASTIC_SAMPLING_SDE) if self.backward_simulation == "renoise" else {}
        return {"sde_type": "cps", "eta": self.cps_eta}

    def _round_items(self) -> tuple[int, str]:
        samples = self.per_device_generation_batch_size
        if self.loss_type == "rtdmd":
            k = self.policy_gradient_steps
            return samples * (k + 1), f"{samples} samples × ({k} PPO steps + the last) = {samples * (k + 1)} items"
        return samples, f"{samples} samples (one state each)"
