"""Configuration of :class:`~trl_dance.DanceGRPOTrainer`."""

import math
import warnings
from dataclasses import dataclass, field

from .rollout_config import RolloutConfig, SDEArguments, _choice

# TRL's GRPOConfig.loss_type values that only choose how per-token losses are averaged: with every sample training the
# same number of transitions they are one loss.
TRL_AGGREGATIONS = ("dapo", "grpo", "bnpo", "dr_grpo")


@dataclass
class TransitionSamplingArguments:
    r"""
    Which steps of a rollout are stochastic and which of their transitions train: the fields [`DanceGRPOConfig`] and
    [`DiffusionOPDConfig`] share (the methods that train sampled transitions x_i → x_{i+1}).

    Parameters:
        last_step_sde (`bool`, defaults to `False`): The last step is never trained. `False`: it is the
            deterministic step (for flow models exactly the predicted clean sample x̂0, as DanceGRPO decodes), so the
            rewarded image carries no sampling noise. `True`: it is an SDE step like the others (Flow-GRPO).

        > Cheaper rollouts: SDE windows (Flow-GRPO-Fast, MixGRPO), MixGRPO-Flash, branching

        sde_window_size (`int` or `None`, defaults to `None`): W consecutive SDE steps per round; every other step
            is the deterministic step (noise 0: Euler ODE, DDIM η=0) and only the window's transitions are stored and
            trained (`timestep_fraction` then applies to W). `None`: every step is stochastic (DanceGRPO, Flow-GRPO).
        sde_window_range (`list[int]` or `None`, defaults to `None`): `[low, high)`, the steps the window may cover
            (Flow-GRPO-Fast SD3: `[0, 5]`). `None`: all trainable steps (the first N−1, or the trained expert's).
        sde_window_schedule (`str`, defaults to `"random"`): `"random"`: a uniform start per round, the same on
            every process (Flow-GRPO-Fast); `"progressive"`: the start advances by `sde_window_stride` every
            `sde_window_stride_rounds` rounds and wraps (MixGRPO). Both follow the round counter, so resuming from a
            checkpoint continues the schedule exactly.
        sde_window_stride (`int`, defaults to `1`), sde_window_stride_rounds (`int`, defaults to `25`): The
            progressive schedule's advance and its period in rounds (MixGRPO: 1 every 25 iterations; Flash: 20).
        post_window_solver (`str`, defaults to `"ode"`): The steps after the window: `"ode"`, the deterministic step;
            `"dpm_solver++"`, DPM-Solver++(2M) (MixGRPO-Flash; flow-matching models).
        post_window_step_ratio (`float`, defaults to `1.0`): With a window, the steps after it are replaced by a grid
            of `max(1, ⌊ratio · remaining⌋)` steps from the window's end to σ = 0 (MixGRPO-Flash: 0.4; flow-matching
            models). 1 keeps the schedule's own steps.
        branching (`bool`, defaults to `False`): The G samples of a group share the deterministic prefix before the
            window, computed once per group instead of G times, and differ from the window on (the original
            Flow-GRPO-Fast, TempFlow-GRPO). Needs a window and `share_initial_noise="group"`.

        > Which transitions train

        timestep_fraction (`float` or `None`, defaults to `None`): Fraction of the trainable steps (the first N−1, or
            the SDE window) trained per sample; the last step is never trained. `None`: 0.6 of the first N−1 steps
            (DanceGRPO) and, with an SDE window, every window step (Flow-GRPO-Fast and MixGRPO train their whole
            window).
        timestep_selection (`str`, defaults to `"random"`): Which of them: `"random"`, drawn per sample (DanceGRPO);
            `"first"` or `"last"`, the earliest or latest (DanceGRPO's ablation: "first 30 %", "last 40 %");
            `"iso_temporal"`, drawn per group, so that every member of a group trains the same steps and their
            advantages compare samples, not timesteps (Flash-GRPO, arXiv 2605.15980). With an SDE window the window
            itself is placed per group (uniformly in `sde_window_range`, from (seed, round, group)) instead of per
            round: Flash-GRPO is `sde_window_size=1` (one SDE step per video, the rest ODE), `sde_window_range`
            `[0, 10]` of 20 steps, `sde_type="flash"`, `temporal_rectification=True`.
    """

    per_device_train_batch_size: int = field(
        default=1, metadata={"help": "Transitions (denoising steps) per micro-batch per process."}
    )
    last_step_sde: bool = field(
        default=False,
        metadata={
            "help": "Sample the last (never trained) step with the SDE too (Flow-GRPO); default: deterministic."
        },
    )
    sde_window_size: int | None = field(
        default=None, metadata={"help": "W consecutive SDE steps per round, ODE elsewhere (None: every step SDE)."}
    )
    sde_window_range: list[int] | None = field(
        default=None, metadata={"help": "[low, high): the steps the window may cover (None: all trainable steps)."}
    )
    sde_window_schedule: str = field(
        default="random",
        metadata={"help": "random | progressive window start.", "choices": ["random", "progressive"]},
    )
    sde_window_stride: int = field(default=1, metadata={"help": "Progressive window: advance of the start."})
    sde_window_stride_rounds: int = field(default=25, metadata={"help": "Progressive window: rounds per advance."})
    post_window_solver: str = field(
        default="ode",
        metadata={"help": "ode | dpm_solver++ after the window.", "choices": ["ode", "dpm_solver++"]},
    )
    post_window_step_ratio: float = field(
        default=1.0, metadata={"help": "Steps after the window, as a fraction of the schedule's (Flash: 0.4)."}
    )
    branching: bool = field(
        default=False, metadata={"help": "A group shares the deterministic prefix before the window."}
    )
    timestep_fraction: float | None = field(
        default=None,
        metadata={"help": "Fraction of the trainable steps trained (None: 0.6, or 1 with an SDE window)."},
    )
    timestep_selection: str = field(
        default="random",
        metadata={
            "help": "random | first | last | iso_temporal (per group) trainable steps.",
            "choices": ["random", "first", "last", "iso_temporal"],
        },
    )

    def _check_transitions(self) -> None:
        _choice("sde_window_schedule", self.sde_window_schedule, ("random", "progressive"))
        _choice("post_window_solver", self.post_window_solver, ("ode", "dpm_solver++"))
        _choice("timestep_selection", self.timestep_selection, ("random", "first", "last", "iso_temporal"))
        if self.timestep_fraction is None:
            self.timestep_fraction = 0.6 if self.sde_window_size is None else 1.0
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        steps = self.num_inference_steps - 1  # trainable at most
        window = self.sde_window_size
        for name in ("sde_window_stride", "sde_window_stride_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if window is not None and not 1 <= window <= steps:
            raise ValueError(
                f"sde_window_size must be in [1, {steps}] (num_inference_steps − 1 = the trainable steps), got {window}"
            )
        if self.sde_window_range is not None:
            if window is None:
                raise ValueError("sde_window_range needs sde_window_size")
            if len(self.sde_window_range) != 2:
                raise ValueError(f"sde_window_range must be [low, high), got {self.sde_window_range}")
            low, high = self.sde_window_range
            if not 0 <= low < high <= steps or high - low < window:
                raise ValueError(
                    f"sde_window_range [{low}, {high}) must lie in the {steps} trainable steps [0, {steps}) and hold "
                    f"sde_window_size ({window}) steps"
                )
        if not 0 < self.post_window_step_ratio <= 1:
            raise ValueError(f"post_window_step_ratio must be in (0, 1], got {self.post_window_step_ratio}")
        needs_window = {
            "branching": self.branching,
            "post_window_solver='dpm_solver++'": self.post_window_solver != "ode",
            "post_window_step_ratio < 1": self.post_window_step_ratio < 1,
        }
        for name, used in needs_window.items():
            if used and window is None:
                raise ValueError(f"{name} applies to SDE-window rollouts: set sde_window_size")
        if window is not None and self.last_step_sde:
            raise ValueError(
                "last_step_sde=True with sde_window_size: outside the window every step is deterministic; unset one"
            )
        if self.branching and self.share_initial_noise != "group":
            raise ValueError(
                "branching shares a group's deterministic prefix, which needs share_initial_noise='group' (got "
                f"{self.share_initial_noise!r}): with per-sample initial noise there is no shared prefix"
            )
        if self.timestep_selection == "iso_temporal" and window is not None:
            clashes = {
                "branching (a group's prefix before a round-wide window)": self.branching,
                f"sde_window_schedule={self.sde_window_schedule!r} (one start per round)": self.sde_window_schedule
                != "random",
                "a compressed grid after the window": self.post_window_step_ratio < 1
                or self.post_window_solver != "ode",
            }
            for what, used in clashes.items():
                if used:
                    raise ValueError(
                        f"timestep_selection='iso_temporal' places the SDE window per group, which excludes {what}"
                    )

    def _round_items(self) -> tuple[int, str]:
        samples, k = self.per_device_trained_samples, self.timesteps_per_sample
        return samples * k, f"{samples} samples × {k} steps = {samples * k} transitions"

    @property
    def per_device_trained_samples(self) -> int:
        """Samples of each process whose transitions are trained per round."""
        return self.per_device_generation_batch_size

    @property
    def timesteps_per_sample(self) -> int:
        """K: transitions trained per sample, of the first N−1 steps or of the SDE window."""
        steps = self.num_inference_steps - 1 if self.sde_window_size is None else self.sde_window_size
        # The tolerance keeps e.g. 15 × 0.6 at 9 whatever the float rounding.
        return max(1, math.floor(steps * self.timestep_fraction + 1e-9))


@dataclass
class DanceGRPOConfig(TransitionSamplingArguments, SDEArguments, RolloutConfig):
    r"""
    Configuration for [`DanceGRPOTrainer`]: GRPO on the denoising chain of diffusion / rectified-flow models.

    Defaults follow the DanceGRPO FLUX.1-dev recipe (16 steps, shift 3, η 0.3, 12 generations per prompt, clip
    range 1e-4, 60% of the first N−1 steps trained, guidance embedding 3.5, 720×720, no KL). Generation, reward,
    advantage and model fields: [`~trl_dance.trainer.rollout_config.RolloutConfig`]; field names follow
    [`trl.GRPOConfig`] where the meaning is the same.

    Units. One *sample* is one generated image or video (a trajectory of N steps). One *transition* is one of its
    denoising steps, ``x_i → x_{i+1}``. Each sample contributes ``K = max(1, ⌊(N − 1) · timestep_fraction⌋)``
    transitions (``⌊W · timestep_fraction⌋`` with an SDE window of W steps; with ``best_of_n_k`` only 2k samples of
    each group are trained). ``per_device_train_batch_size`` counts **transitions** per micro-batch; each process generates
    ``generation_batch_size / num_processes`` samples per round, so a round has ``steps_per_generation =
    (trained samples per process) · K / per_device_train_batch_size`` micro-batches, each consumed by one
    ``training_step``, and ``steps_per_generation · num_iterations / gradient_accumulation_steps`` optimizer updates.
    Left unset, ``gradient_accumulation_steps`` is the smallest divisor of a round's micro-batches that gives at most
    3 updates per round (DanceGRPO's FLUX recipe: 12 samples × 9 transitions, 36 per update); a value given must
    divide them.

    Parameters:
        > SDE sampling

        sde_type (`str`, defaults to `"dance"`): Stochastic step: `"dance"` (constant diffusion η),
            `"flow_grpo"` (η·sqrt(σ/(1−σ))), `"cps"` (coefficients-preserving, pseudo log-prob), `"flash"`
            (Flash-GRPO: η·(σ_min + (σ_max − σ_min)·σ) with the schedule's σ after 1 as σ_max and its last as σ_min;
            η = 1 is the paper's; flow-matching models).
        eta (`float`, defaults to `0.3`): Noise level of the SDE (η, or `a` for flow_grpo/cps). Must be > 0.
        log_prob_reduction (`str`, defaults to `"mean"`): Reduce per-element log-densities by `"mean"` (the
            convention the clip range 1e-4 is tuned for) or `"sum"`.

        > Transition sampling (windows, MixGRPO-Flash, branching, which steps train): see
        [`~trl_dance.trainer.dance_grpo_config.TransitionSamplingArguments`]

        > Optimization

        trust_region (`str`, defaults to `"clip"`): How updates stay near the rollout policy. `"clip"`: PPO's ratio clip
            with `epsilon`. `"dppo"`: Flow-DPPO's (arXiv 2606.11025) exact trust region: per transition the KL of the
            two step Gaussians, mean((μ_old − μ_θ)²)/(2·std²) over the latent, with μ_old stored at rollout; the
            loss is mean(−A·ρ·keep) with keep = 0 only where that KL ≥ `dppo_kl_threshold` *and* the update went
            further the advantage's way (ρ > 1 with A > 0, or ρ < 1 with A < 0). Meant for several updates per round
            (`gradient_accumulation_steps` < a round's micro-batches, or `num_iterations` > 1), where ratio clipping
            degrades. Composes with windows, branching, `ratio_normalization` (ρ) and `step_reweighting`.
        dppo_kl_threshold (`float`, defaults to `1e-6`): τ of `trust_region="dppo"` (Flow-DPPO's default), in nats
            per latent element.
        dppo_kl_space (`str`, defaults to `"x"`): The space of that KL (Flow-Factory's `kl_mask_type`): `"x"`, the
            step Gaussians' KL above; `"v"`, mean((v_θ − v_old)²) on the network outputs, computed exactly from the
            stored means since a step's mean is affine in the output (= 2·KL/g_t², g_t = |∂μ/∂output|/std).
        epsilon (`float`, defaults to `1e-4`): PPO clip range of the ratio (its lower bound, 1 − epsilon).
        loss_type (`str`, defaults to `"dapo"`): TRL's GRPO aggregation names, accepted so that TRL configs carry over:
            `"grpo"`, `"bnpo"`, `"dr_grpo"` and `"dapo"` give the same loss here, since every sample trains the same
            number of transitions (TRL's modes differ only with completions of different lengths). TRL's other losses
            (`"cispo"`, `"sapo"`, `"luspo"`, `"vespo"`) are refused: `trust_region` and `epsilon` are this trainer's
            ways to bound an update.
        epsilon_high (`float` or `None`, defaults to `None`): Upper clip bound 1 + epsilon_high (asymmetric clip, as in
            TRL); `None`: `epsilon`.
        ratio_normalization (`bool`, defaults to `False`): GRPO-Guard's ratio normalisation: the log-ratio becomes
            s·(ℓ − ℓ_old + mean((μ − μ_old)²)/(2s²)) = mean(z·(μ − μ_old)) with the stored rollout mean μ_old and
            the transition's std s, which removes the ratio's downward bias and its 1/s growth at low-noise steps.
            Stores each window step's mean (one more latent per transition). Gaussian SDEs only (not `"cps"`).
        rollout_backprop (`bool`, defaults to `False`): Recompute-free GRPO (LeanGRPO's "Retain", arXiv 2609.03528):
            the rollout runs each trained transition's denoiser call with gradients and keeps its graph, and once the
            rewards are in, one backward of the same loss (at ratio 1: −A·∇log p per transition) gives the round's
            update, so no training forward repeats a rollout's. Exact with one optimizer update per round
            (`gradient_accumulation_steps` = the round's micro-batches, the default with this option), DDP or one
            process, no KL (`beta` 0), the clip trust region without ratio normalisation, no `best_of_n_k` and no
            per-group windows; the rest is refused. Memory: the graphs of all of a process's trained transitions are
            held until the rewards arrive (with activation checkpointing, each block's input per transition).
        step_reweighting (`bool`, defaults to `False`): GRPO-Guard's gradient reweighting: each transition's policy
            loss is divided by its Δσ = σ_i − σ_{i+1}, which equalises the steps' gradients. Flow-matching models.
        kl_scaling (`str`, defaults to `"gaussian"`): Units of the KL term, mean((μ_θ − μ_ref)²) over the latent
            divided by: `"gaussian"`, 2·std² with std the step's standard deviation (the exact KL between the two
            steps' Gaussians); `"flow_grpo"`, 2·s² with s the SDE's diffusion coefficient (std = s·√Δ), i.e. the
            exact KL times Δ = σ_i − σ_{i+1}, as Flow-GRPO computes it, so its β (0.01–0.04) transfers. With
            `sde_type="cps"` both are the exact KL: CPS's std is already the step's own, and Flow-GRPO divides by its
            square. Flow models only.
        temporal_rectification (`bool`, defaults to `False`): Flash-GRPO's temporal gradient rectification: each
            transition's policy loss is multiplied by 1/g_t, g_t = |∂μ/∂output|/std the scale at which the step's
            log-probability responds to the network output (flow: Δσ·(1 + s²(1−σ)/(2σ))/(s·√Δσ)), normalised to
            mean 1 over the candidate steps, so every timestep's gradient has one scale. Not with `"cps"` (pseudo
            log-prob) nor `step_reweighting` (another reweighting of the same steps).
        best_of_n_k (`int` or `None`, defaults to `None`): Train only the k highest and the k lowest advantages of
            each group (DanceGRPO's video recipe: 4 + 4 of 24); every process must hold whole groups. `None`: all.
    """

    updates_per_round = 3  # DanceGRPO's FLUX recipe: 12 samples × 9 transitions in 3 updates

    epsilon: float = field(default=1e-4, metadata={"help": "PPO clip range."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip range (None: epsilon)."})
    loss_type: str = field(
        default="dapo",
        # No argparse choices: TRL's other losses get the error that says what to use instead.
        metadata={
            "help": "TRL's aggregation names; grpo | bnpo | dr_grpo | dapo are the same loss here (equal lengths)."
        },
    )
    ratio_normalization: bool = field(default=False, metadata={"help": "GRPO-Guard ratio normalisation."})
    trust_region: str = field(
        default="clip", metadata={"help": "clip (PPO) | dppo (Flow-DPPO's KL mask).", "choices": ["clip", "dppo"]}
    )
    dppo_kl_threshold: float = field(default=1e-6, metadata={"help": "Flow-DPPO's KL threshold τ (nats/element)."})
    dppo_kl_space: str = field(
        default="x",
        metadata={"help": "x (step Gaussians' KL) | v (output MSE) for the DPPO mask.", "choices": ["x", "v"]},
    )
    step_reweighting: bool = field(default=False, metadata={"help": "GRPO-Guard 1/Δσ step reweighting."})
    rollout_backprop: bool = field(
        default=False,
        metadata={"help": "Recompute-free GRPO: the update's gradient through the rollout's own forwards."},
    )
    kl_scaling: str = field(
        default="gaussian",
        metadata={
            "help": "gaussian (exact KL) | flow_grpo (exact KL × Δσ, Flow-GRPO's units).",
            "choices": ["gaussian", "flow_grpo"],
        },
    )
    temporal_rectification: bool = field(
        default=False, metadata={"help": "Flash-GRPO: divide each step's loss by its log-prob gradient scale."}
    )
    best_of_n_k: int | None = field(
        default=None, metadata={"help": "Train only the k highest and k lowest advantages of each group."}
    )

    def _check_method(self) -> None:
        self._check_sde("a deterministic step has no log-probability")
        self._check_transitions()
        _choice("kl_scaling", self.kl_scaling, ("gaussian", "flow_grpo"))
        _choice("trust_region", self.trust_region, ("clip", "dppo"))
        if self.loss_type in ("cispo", "sapo", "luspo", "vespo"):
            raise ValueError(
                f"loss_type={self.loss_type!r} is one of TRL's LLM losses, not implemented for diffusion: bound updates "
                "with trust_region='clip' (epsilon, epsilon_high) or 'dppo' (Flow-DPPO's KL mask); the aggregation "
                f"names {list(TRL_AGGREGATIONS)} are accepted and all give this trainer's loss"
            )
        _choice("loss_type", self.loss_type, TRL_AGGREGATIONS)
        _choice("dppo_kl_space", self.dppo_kl_space, ("x", "v"))
        if not (self.dppo_kl_threshold > 0 and math.isfinite(self.dppo_kl_threshold)):
            raise ValueError(f"dppo_kl_threshold must be a positive number, got {self.dppo_kl_threshold}")
        if not self.epsilon > 0 or not math.isfinite(self.epsilon):
            raise ValueError(f"epsilon must be > 0, got {self.epsilon}")
        self._check_policy_gradient()
        if self.best_of_n_k is not None:
            self._check_whole_groups("best_of_n_k selects within")

    def __post_init__(self):
        if self.rollout_backprop and self.gradient_accumulation_steps is None:
            self.updates_per_round = 1  # the default then accumulates the whole round into one update
        super().__post_init__()
        self._check_rollout_backprop()
        if self.trust_region == "dppo" and self.optimizer_updates_per_round == 1:
            warnings.warn(
                "trust_region='dppo' with one optimizer update per round: the update starts on-policy (KL 0 to the "
                "rollout), so its mask never acts and the loss is the clip's. It is meant for several updates per "
                "round (gradient_accumulation_steps below the round's micro-batches, or num_iterations > 1)",
                stacklevel=3,
            )

    def _check_rollout_backprop(self) -> None:
        if not self.rollout_backprop:
            return
        updates = self.optimizer_updates_per_round
        inexact = {
            f"{updates} optimizer updates per round (gradient_accumulation_steps must equal the round's "
            f"{self.round_micro_steps} micro-batches, steps_per_generation × num_iterations): after the first the "
            "policy has moved from the one that rolled out": updates != 1,
            "beta > 0: the KL term needs the reference model's forward at each transition": self.beta > 0,
            "ratio_normalization: the normalised ratio is not the log-probability the rollout differentiates": (
                self.ratio_normalization
            ),
            "trust_region='dppo': its mask is meant for several updates per round": self.trust_region == "dppo",
            "best_of_n_k: which samples train is known only once the rewards are": self.best_of_n_k is not None,
            "timestep_selection='iso_temporal' with an SDE window: a window per group": (
                self.timestep_selection == "iso_temporal" and self.sde_window_size is not None
            ),
            "context_parallel_size > 1": self.context_parallel_size > 1,
            "max_staleness > 0: the rollout's weights are rounds older than the trained ones": self.max_staleness > 0,
            "rollout_server_urls: the rollouts run on workers": bool(self.rollout_server_urls),
        }
        for why, used in inexact.items():
            if used:
                raise ValueError(f"rollout_backprop is exact only at one on-policy update per round; not with {why}")

    def _check_policy_gradient(self) -> None:
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ValueError(f"epsilon_high must be > 0 (or None), got {self.epsilon_high}")
        if self.temporal_rectification and (self.sde_type == "cps" or self.step_reweighting):
            raise ValueError(
                "temporal_rectification divides out the Gaussian log-probability's gradient scale: not with "
                "sde_type='cps' (a pseudo log-prob) nor with step_reweighting (another per-step weight)"
            )
        if self.ratio_normalization and self.sde_type == "cps":
            raise ValueError(
                "ratio_normalization needs a Gaussian log-probability; sde_type='cps' has a pseudo log-prob. Use "
                "sde_type 'dance' or 'flow_grpo'"
            )
        if self.best_of_n_k is not None and not 1 <= 2 * self.best_of_n_k <= self.num_generations:
            raise ValueError(
                f"best_of_n_k={self.best_of_n_k} trains 2k samples of each group of num_generations "
                f"({self.num_generations}): need 1 <= k <= {self.num_generations // 2}"
            )

    @property
    def per_device_trained_samples(self) -> int:
        """Samples of each process whose transitions are trained per round (2k per group with ``best_of_n_k``)."""
        local = self.per_device_generation_batch_size
        if self.best_of_n_k is None:
            return local
        return local // self.num_generations * 2 * self.best_of_n_k
