"""Configuration of :class:`~trl_dance.DiffusionNFTTrainer`."""

import math
from dataclasses import dataclass, field

from ..losses import AWM_WEIGHTINGS
from .rollout_config import RolloutConfig, _choice

LOSS_TYPES = ("nft", "awm", "dgpo", "art")
DECAYS = ("linear", "delayed", "none")
SELECTIONS = ("random", "stratified", "first")
# Each loss type's own paper: timestep_fraction, timestep_selection, old_policy_decay, ema_kl_beta, dgpo_clip,
# rollout_solver.
LOSS_DEFAULTS = {
    "nft": (0.99, "random", "linear", 0.0, 0.0, "dpm_solver++"),
    "awm": (0.45, "stratified", "none", 1.0, 0.0, "dpm_solver++"),
    "dgpo": (0.6, "first", "none", 0.0, 1e-2, "dpm_solver++"),
    "art": (0.99, "random", "none", 0.0, 0.0, "ode"),  # the rollout's own states and predictions are the targets
}


@dataclass
class DiffusionNFTConfig(RolloutConfig):
    r"""
    Configuration for [`DiffusionNFTTrainer`]: reinforcement learning on the forward (noising) process.

    Defaults follow DiffusionNFT's SD3.5-Medium recipe (NVlabs/DiffusionNFT `config/nft.py`): 10 deterministic
    second-order (DPM-Solver++) steps on the pipeline's σ grid without CFG, 24 generations per prompt, advantages
    from each prompt's mean and the batch's standard deviation + 1e-4 (its `global_std`), NFT β 1, KL β 1e-4, 9 of the
    10 noise levels per sample, lr 3e-4 for LoRA, the linear old-policy decay, one optimizer update per round.
    `loss_type="awm"`, `"dgpo"` and `"art"` take their own papers' defaults where this config leaves a field unset
    (`None`); see each field. Generation, reward, advantage and model fields:
    [`~trl_dance.trainer.rollout_config.RolloutConfig`].

    Units. Rollouts store one clean latent per sample. Each sample gives ``K = max(1, ⌊N · timestep_fraction⌋)``
    *training items*: the sample re-noised, with fresh noise, to K distinct noise levels of the rollout's grid.
    ``per_device_train_batch_size`` counts items; a round has ``samples per process · K / per_device_train_batch_size``
    micro-batches. Left unset, ``gradient_accumulation_steps`` is all of them: one optimizer update per round, as
    the paper's recipes (two for OCR).

    Parameters:
        > Rollouts

        share_initial_noise (`str`, defaults to `"none"`): Every sample starts from its own noise: the rollouts are
            deterministic, so a shared start would make a group's samples identical.

        rollout_solver (`str` or `None`, defaults to `None`): The deterministic sampler of the rollouts: `"ode"`, the
            policy's own deterministic step (Euler for flow models); `"dpm_solver++"`, DPM-Solver++(2M) on the same grid
            (the paper's `dpm2`). `None`: `"dpm_solver++"`, or `"ode"` for ART (which regresses on the states the
            policy's own steps visit).
        sigma_schedule (`str`, defaults to `"pipeline"`): the pipeline's own σ grid, as the paper samples (at N = 10 the
            `"dance"` grid would end at σ 0.25, the pipeline's at ~0.003).
        scale_rewards (`str`, defaults to `"batch"`): each prompt's mean and the batch's standard deviation (+ 1e-4),
            the paper's `global_std` per-prompt statistics.
        train_guidance_scale (`float` or `None`, defaults to `None`): The guidance of the training forwards; `None`:
            `guidance_scale`. DGPO's main mode samples with CFG 4.5 (`guidance_scale`) and trains CFG-free (1).

        > Loss

        loss_type (`str`, defaults to `"nft"`): `"nft"`: DiffusionNFT's negative-aware loss (against the old policy);
            `"awm"`: advantage weighted matching (arXiv 2509.25050), the weighted flow-matching loss as a surrogate
            log-likelihood, PPO-clipped against the old policy; `"dgpo"`: direct group preference optimisation (arXiv
            2510.08425), flow-matching losses weighted by A and a group weight from the policy-vs-reference loss
            differences at noise shared within each group (micro-batches hold whole groups); `"art"`: DiffusionART
            (arXiv 2610.12572), the velocity regressed, at states the ODE rollouts visited, toward targets frozen at
            rollout: the rollout's own clean prediction moved by `art_step_size`·λ(σ)·G(c), G(c) the prompt's
            reward–endpoint covariance normalised after aggregation (:func:`~trl_dance.losses.art_guidance`); each
            round is consumed in `art_update_windows` optimizer updates on disjoint parts of every group, so the later
            ones restore toward the rollout policy. A groupwise pairwise reward (win rates; with 2 generations labels 1,
            0, ½) gives its pairwise mode; `timestep_selection="first"` with a small `timestep_fraction` is ART-Flash
            (high-noise positions only). How G(c) enters the target is this project's reading (the paper's formula is
            not public; `docs/methods/nft.md`).
        art_step_size (`float`, defaults to `1.0`): η, how far the target's clean sample moves along the unit-RMS
            guidance at pure noise (latent units; λ(σ) = σ²/((1 − σ)² + σ²) scales it down with the noise).
        art_update_windows (`int`, defaults to `2`): optimizer updates (disjoint parts of every group) per round.
        awm_weighting (`str`, defaults to `"ghuber"`): AWM's surrogate −log π = w(ℓ, σ): `"ghuber"`
            σ·((ℓ + ε)^p − ε^p)/p with ε = 1e-10 and p = `awm_ghuber_power` (AWM's default), `"sigma"` σ·ℓ,
            `"uniform"` ℓ.
        awm_ghuber_power (`float`, defaults to `0.25`): p of the `"ghuber"` weighting.
        epsilon (`float`, defaults to `1.0`): AWM's clip range of the ratio (AWM's 1 leaves it nearly inactive;
            Flow-Factory advises 1e-5 for stability). AWM's ratio is against θ at the start of the round, which also
            samples the round (`old_policy_decay` is `"none"` for AWM), and its advantages are divided by
            `adv_clip_max` (its `advantage_max` 1: A in [−1, 1]).
        ema_kl_beta (`float` or `None`, defaults to `None`): β of mean((v_θ − v_ema)²) against a fast EMA of the trained
            weights, decay min(0.3, 0.001·step) after every optimizer update (AWM's `ema_beta`, "mimicking TRPO").
            `None`: 1 for AWM, 0 otherwise.
        dgpo_beta (`float`, defaults to `100.0`): DGPO's β in the group weight sigmoid(β/G · Σ A·δ).
        dgpo_clip (`float` or `None`, defaults to `None`): DGPO's `clip_dsm`: with ρ = exp(ℓ_old − ℓ_θ) against the same
            fast EMA, ℓ_θ's gradient is stopped where ρ > 1 + c and A > 0 or ρ < 1 − c and A < 0. `None`: 1e-2 for
            DGPO. 0 disables it.
        nft_beta (`float`, defaults to `1.0`): NFT's β: the implicit policies are v± = v_old ± β·(v_θ − v_old)
            (0.1 for OCR and multi-reward runs in the paper).
        timestep_fraction (`float` or `None`, defaults to `None`): Noise levels trained per sample, K = ⌊N ·
            fraction⌋ of the rollout grid. `None`: 0.99 (NFT: 9 of 10), 0.45 (AWM: 6 of 14), 0.6 (DGPO: 6 of 10).
        timestep_selection (`str` or `None`, defaults to `None`): Which K levels: `"random"`, K distinct levels per
            sample (NFT); `"stratified"`, one level from each of K equal strata of the grid's levels 1 … ⌊0.9·N⌋
            (AWM: neither σ = 1 nor the last tenth); `"first"`, the K highest-noise levels (DGPO trains only those).
            `None`: the loss type's.
        old_policy_decay (`str` or `None`, defaults to `None`): λ of the old policy's update old ← λ·old + (1 − λ)·θ,
            from the optimizer step: `"linear"` min(0.001·step, 0.5) (NFT's default); `"delayed"` 0 for 75 steps,
            then min(0.0075·(step − 75), 0.999) (the paper's OCR setting); `"none"` 0 (the old policy is θ as the
            round starts: AWM's default).
        old_policy_update (`str`, defaults to `"step"`): When NFT's old policy moves: `"step"`, after every optimizer
            update; `"round"`, once per round (DiffusionNFT's code, whose recipes make one or two updates per round).
            Identical with one update per round. NFT's loss is minimised at v_θ − v_old = (2r − 1)(v* − v_old)/β, so
            within a round the later updates of `"round"` pull θ back to that optimum instead of learning further
            (`tests/test_diffusion_nft.py` measures it); `"step"` re-anchors every update. AWM always uses `"round"`
            (its ratio is against θ at the round's start).
        flow_map_diffusion_ratio (`float`, defaults to `0.5`), flow_map_consistency_ratio (`float`, defaults to
            `0.25`), flow_map_cd_epsilon (`float`, defaults to `0.005`): MeanFlowNFT (arXiv 2607.15273) on flow-map
            checkpoints (HunyuanVideo 1.5 MeanFlow), `loss_type="nft"`: each item at its noise level t also gets an
            end time r, r = t for the first fraction of items (the instantaneous velocity), r = 0 for the next, r ~
            U(0, t) for the rest, and NFT runs on the induced instantaneous velocity V = u(x_t, r, t) + (t − r)·dF/dt,
            dF/dt the old policy's central difference along the path, (u(x_t + ε·(ε_noise − x0), r, t + ε) − u(x_t −
            ε·(ε_noise − x0), r, t − ε))/(2ε), shared by θ, old and reference (so V_θ − V_old = u_θ − u_old).
        beta (`float`, defaults to `1e-4`): KL coefficient: β·mean((v_θ − v_ref)²) with v_ref the LoRA-disabled base
            (a frozen copy for full fine-tuning).
    """

    # Overridden defaults (DiffusionNFT's SD3.5-M recipe).
    updates_per_round = 1  # the paper's gradient_step_per_epoch (2 for OCR); ART: one per window
    learning_rate: float = field(default=3e-4, metadata={"help": "AdamW learning rate (DiffusionNFT LoRA: 3e-4)."})
    per_device_train_batch_size: int = field(
        default=9, metadata={"help": "Training items (re-noised samples) per micro-batch per process."}
    )
    num_generations: int = field(default=24, metadata={"help": "Samples per prompt (group size G)."})
    num_inference_steps: int = field(default=10, metadata={"help": "Denoising steps N of the rollouts."})
    height: int = field(default=512, metadata={"help": "Image height in pixels."})
    width: int = field(default=512, metadata={"help": "Image width in pixels."})
    guidance_scale: float = field(default=1.0, metadata={"help": "CFG scale (1: none, the method's default)."})
    beta: float = field(default=1e-4, metadata={"help": "KL coefficient to the reference model (0: no KL)."})
    share_initial_noise: str = field(
        default="none",
        metadata={"help": "none: every sample its own initial noise (deterministic rollouts).", "choices": ["none"]},
    )

    sigma_schedule: str = field(
        default="pipeline", metadata={"help": "pipeline | dance σ grid.", "choices": ["dance", "pipeline"]}
    )
    scale_rewards: str = field(
        default="batch", metadata={"help": "Advantage statistics (batch: the paper's global std)."}
    )
    rollout_solver: str | None = field(
        default=None,
        metadata={"help": "ode | dpm_solver++ rollouts (None: by loss type).", "choices": ["ode", "dpm_solver++"]},
    )
    train_guidance_scale: float | None = field(
        default=None, metadata={"help": "Guidance of the training forwards (None: guidance_scale)."}
    )
    loss_type: str = field(default="nft", metadata={"help": "nft | awm | dgpo | art.", "choices": list(LOSS_TYPES)})
    art_step_size: float = field(default=1.0, metadata={"help": "ART's η: the target's move along the guidance."})
    art_update_windows: int = field(
        default=2, metadata={"help": "ART: optimizer updates (disjoint windows) per round."}
    )
    nft_beta: float = field(default=1.0, metadata={"help": "NFT's β (implicit policy distance)."})
    awm_weighting: str = field(
        default="ghuber",
        metadata={"help": "AWM surrogate weighting: ghuber | sigma | uniform.", "choices": list(AWM_WEIGHTINGS)},
    )
    awm_ghuber_power: float = field(default=0.25, metadata={"help": "p of AWM's ghuber weighting."})
    epsilon: float = field(default=1.0, metadata={"help": "AWM's clip range."})
    ema_kl_beta: float | None = field(
        default=None, metadata={"help": "β to a fast EMA of the weights (None: AWM 1, else 0)."}
    )
    dgpo_beta: float = field(default=100.0, metadata={"help": "DGPO's β."})
    dgpo_clip: float | None = field(default=None, metadata={"help": "DGPO's clip_dsm (None: 1e-2 for DGPO)."})
    timestep_fraction: float | None = field(
        default=None, metadata={"help": "Fraction of the N noise levels trained per sample (None: by loss type)."}
    )
    timestep_selection: str | None = field(
        default=None,
        metadata={"help": "random | stratified | first (None: by loss type).", "choices": list(SELECTIONS)},
    )
    old_policy_decay: str | None = field(
        default=None, metadata={"help": "linear | delayed | none (None: by loss type).", "choices": list(DECAYS)}
    )
    flow_map_diffusion_ratio: float = field(default=0.5, metadata={"help": "MeanFlowNFT: items with r = t."})
    flow_map_consistency_ratio: float = field(default=0.25, metadata={"help": "MeanFlowNFT: items with r = 0."})
    flow_map_cd_epsilon: float = field(default=0.005, metadata={"help": "MeanFlowNFT: central-difference step (σ)."})
    old_policy_update: str = field(
        default="step", metadata={"help": "step | round: when NFT's old policy moves.", "choices": ["step", "round"]}
    )

    def _check_method(self) -> None:
        _choice("loss_type", self.loss_type, LOSS_TYPES)
        names = ("timestep_fraction", "timestep_selection", "old_policy_decay", "ema_kl_beta", "dgpo_clip")
        for name, default in zip((*names, "rollout_solver"), LOSS_DEFAULTS[self.loss_type]):
            if getattr(self, name) is None:
                setattr(self, name, default)
        _choice("rollout_solver", self.rollout_solver, ("ode", "dpm_solver++"))
        _choice("old_policy_decay", self.old_policy_decay, DECAYS)
        _choice("timestep_selection", self.timestep_selection, SELECTIONS)
        _choice("old_policy_update", self.old_policy_update, ("step", "round"))
        for name in ("ema_kl_beta", "dgpo_clip"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.share_initial_noise != "none":
            raise ValueError(
                f"share_initial_noise={self.share_initial_noise!r}: deterministic rollouts from a shared initial noise "
                "make a group's samples identical (zero advantages); DiffusionNFT needs share_initial_noise='none'"
            )
        _choice("awm_weighting", self.awm_weighting, AWM_WEIGHTINGS)
        for name in ("nft_beta", "epsilon", "dgpo_beta", "awm_ghuber_power"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.loss_type == "dgpo":
            self._check_whole_groups(
                "loss_type='dgpo' weighs", per_device_train_batch_size=self.per_device_train_batch_size
            )
        ratios = (self.flow_map_diffusion_ratio, self.flow_map_consistency_ratio)
        if min(ratios) < 0 or sum(ratios) > 1:
            raise ValueError(
                f"flow_map_diffusion_ratio and flow_map_consistency_ratio must be >= 0 with a sum <= 1, got {ratios}"
            )
        if not 0 < self.flow_map_cd_epsilon < 0.5:
            raise ValueError(f"flow_map_cd_epsilon must be in (0, 0.5), got {self.flow_map_cd_epsilon}")
        if self.loss_type == "art":
            self._check_art()
            self.updates_per_round = self.art_update_windows
        if not self.adv_clip_max > 0:
            raise ValueError(f"adv_clip_max must be > 0: it maps advantages to probabilities, got {self.adv_clip_max}")

    def _check_art(self) -> None:
        windows = self.art_update_windows
        if not self.art_step_size > 0 or not math.isfinite(self.art_step_size):
            raise ValueError(f"art_step_size must be > 0, got {self.art_step_size}")
        if windows < 1 or self.num_generations % windows:
            raise ValueError(
                f"art_update_windows ({windows}) must be >= 1 and divide num_generations ({self.num_generations}): "
                "every window trains an equal part of every group"
            )
        self._check_whole_groups("loss_type='art' aggregates each prompt's guidance over")
        if self.old_policy_decay != "none" or self.max_staleness:
            raise ValueError(
                "loss_type='art' freezes its targets from the predictions of θ at the round's start, which its "
                f"rollout records: old_policy_decay must be 'none' and max_staleness 0 (a lagging old policy or an "
                f"older round's rollout gives other targets), got {self.old_policy_decay!r} and {self.max_staleness}"
            )
        if self.rollout_solver != "ode":
            raise ValueError(
                f"loss_type='art' regresses on the states the policy's own deterministic steps visit, with the "
                f"rollout's predictions as targets: rollout_solver must be 'ode', got {self.rollout_solver!r}"
            )
        if self.train_guidance_scale not in (None, self.guidance_scale):
            raise ValueError(
                f"loss_type='art' freezes its targets from the rollout's predictions (guidance {self.guidance_scale}): "
                f"train_guidance_scale {self.train_guidance_scale} would regress another guidance onto them"
            )
        items = self.per_device_generation_batch_size // windows * self.timesteps_per_sample
        if items % self.per_device_train_batch_size:
            raise ValueError(
                f"each ART window trains {items} items per process, which per_device_train_batch_size "
                f"({self.per_device_train_batch_size}) must divide"
            )

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type == "art" and self.optimizer_updates_per_round % self.art_update_windows:
            raise ValueError(
                f"loss_type='art' needs whole windows per optimizer update: {self.optimizer_updates_per_round} "
                f"updates per round (gradient_accumulation_steps {self.gradient_accumulation_steps}) is not a "
                f"multiple of art_update_windows ({self.art_update_windows}): gradient_accumulation_steps "
                f"{self.round_micro_steps // self.art_update_windows} makes one update per window"
            )

    def _round_items(self) -> tuple[int, str]:
        samples, k = self.per_device_generation_batch_size, self.timesteps_per_sample
        return samples * k, f"{samples} samples × {k} noise levels = {samples * k} items"

    @property
    def timesteps_per_sample(self) -> int:
        """K: noise levels trained per sample."""
        return max(1, math.floor(self.num_inference_steps * self.timestep_fraction + 1e-9))
