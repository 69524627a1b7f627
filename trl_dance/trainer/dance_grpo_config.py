"""Configuration of :class:`~trl_dance.DanceGRPOTrainer`."""

import math
from dataclasses import dataclass, field
from typing import Any

from .._compat import _BaseConfig
from ..advantages import DEFAULT_EPSILON
from .frozen_components import FrozenComponentsArguments

_SDE_TYPES = ("dance", "flow_grpo", "cps")
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass
class DanceGRPOConfig(FrozenComponentsArguments, _BaseConfig):
    r"""
    Configuration for [`DanceGRPOTrainer`]: GRPO on the denoising chain of diffusion / rectified-flow models.

    Defaults follow the DanceGRPO FLUX.1-dev recipe (16 steps, shift 3, η 0.3, 12 generations per prompt, clip
    range 1e-4, 60% of the first N−1 steps trained, guidance embedding 3.5, 720×720, no KL). Field names follow
    [`trl.GRPOConfig`] where the meaning is the same.

    Units. One *sample* is one generated image or video (a trajectory of N steps). One *transition* is one of its
    denoising steps, ``x_i → x_{i+1}``. Each sample contributes ``K = max(1, ⌊(N − 1) · timestep_fraction⌋)``
    transitions (``⌊W · timestep_fraction⌋`` with an SDE window of W steps; with ``best_of_n_k`` only 2k samples of
    each group are trained). ``per_device_train_batch_size`` counts **transitions** per micro-batch; each process generates
    ``generation_batch_size / num_processes`` samples per round, so a round has ``steps_per_generation =
    (trained samples per process) · K / per_device_train_batch_size`` micro-batches, each consumed by one
    ``training_step``, and ``steps_per_generation · num_iterations / gradient_accumulation_steps`` optimizer updates.

    Parameters:
        > Generation

        num_generations (`int`, defaults to `12`): Group size G: samples per prompt (>= 2).
        generation_batch_size (`int` or `None`, defaults to `None`): Samples per round over all processes; a
            multiple of `num_generations` and of the number of processes. `None`: one group per process.
        rollout_batch_size (`int` or `None`, defaults to `None`): Samples denoised together per process (memory
            knob; results do not depend on it beyond float rounding). `None`: the whole local generation batch.
        num_inference_steps (`int`, defaults to `16`): Denoising steps N per sample.
        height (`int`, defaults to `720`), width (`int`, defaults to `720`): Image size in pixels.
        num_frames (`int` or `None`, defaults to `None`): Frames per video (video pipelines only; Wan: 1 + a
            multiple of 4). `None`: the family's default (81 for Wan).
        guidance_scale (`float`, defaults to `3.5`): FLUX: the guidance embedding (no CFG). SD3: CFG scale, the
            loss then goes through the CFG-combined prediction (1 disables CFG).
        max_sequence_length (`int`, defaults to `512`): T5 tokens of the prompt.
        negative_prompt (`str` or `None`, defaults to `None`): The prompt of CFG's unconditional branch (with CFG
            only). `None`: the pipeline's own unconditional embedding (the empty prompt; zeros for SDXL base).
        train_expert (`str`, defaults to `"high_noise"`): Two-expert pipelines (Wan 2.2 A14B): the expert trained,
            `"high_noise"` (`transformer`, the steps with timestep >= boundary_ratio · 1000) or `"low_noise"`
            (`transformer_2`); the other serves its steps frozen, and the K transitions of each sample are drawn
            among the trained expert's steps.
        guidance_scale_2 (`float` or `None`, defaults to `None`): Two-expert pipelines: the CFG scale of the
            low-noise expert's steps. `None`: `guidance_scale`.
        offload_frozen_expert (`bool`, defaults to `False`): Two-expert pipelines: keep the frozen expert on the CPU
            except during rollouts, one transfer each way per round, so training does not hold it (Wan 2.2 A14B:
            28 GB in bf16).
        sde_type (`str`, defaults to `"dance"`): Stochastic step: `"dance"` (constant diffusion η),
            `"flow_grpo"` (η·sqrt(σ/(1−σ))), `"cps"` (coefficients-preserving, pseudo log-prob).
        eta (`float`, defaults to `0.3`): Noise level of the SDE (η, or `a` for flow_grpo/cps). Must be > 0.
        sigma_schedule (`str`, defaults to `"dance"`): `"dance"`: σ_k = s·u/(1+(s−1)u) with `shift`; `"pipeline"`:
            the σ the pipeline itself samples with (FLUX: linspace(1, 1/N) with its resolution-dependent shift; SD3,
            Wan: its scheduler's static shift).
        shift (`float`, defaults to `3.0`): Shift s of the `"dance"` schedule.
        share_initial_noise (`str`, defaults to `"group"`): `"group"`: the G samples of a prompt start from the same
            noise; `"none"`: every sample has its own.
        log_prob_reduction (`str`, defaults to `"mean"`): Reduce per-element log-densities by `"mean"` (the
            convention the clip range 1e-4 is tuned for) or `"sum"`.
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

        > Optimization

        num_iterations (`int`, defaults to `1`): Passes over each round's transitions (μ in GRPO).
        epsilon (`float`, defaults to `1e-4`): PPO clip range of the ratio (its lower bound, 1 − epsilon).
        epsilon_high (`float` or `None`, defaults to `None`): Upper clip bound 1 + epsilon_high (asymmetric clip, as in
            TRL); `None`: `epsilon`.
        ratio_normalization (`bool`, defaults to `False`): GRPO-Guard's ratio normalisation: the log-ratio becomes
            s·(ℓ − ℓ_old + mean((μ − μ_old)²)/(2s²)) = mean(z·(μ − μ_old)) with the stored rollout mean μ_old and
            the transition's std s, which removes the ratio's downward bias and its 1/s growth at low-noise steps.
            Stores each window step's mean (one more latent per transition). Gaussian SDEs only (not `"cps"`).
        step_reweighting (`bool`, defaults to `False`): GRPO-Guard's gradient reweighting: each transition's policy
            loss is divided by its Δσ = σ_i − σ_{i+1}, which equalises the steps' gradients. Flow-matching models.
        beta (`float`, defaults to `0.0`): KL coefficient to the reference (the model with LoRA disabled, or a
            frozen copy for full fine-tuning). 0 disables the KL term and its extra forward pass.
        kl_scaling (`str`, defaults to `"gaussian"`): Units of the KL term, mean((μ_θ − μ_ref)²) over the latent
            divided by: `"gaussian"`, 2·std² with std the step's standard deviation (the exact KL between the two
            steps' Gaussians); `"flow_grpo"`, 2·s² with s the SDE's diffusion coefficient (std = s·√Δ), i.e. the
            exact KL times Δ = σ_i − σ_{i+1}, as Flow-GRPO computes it, so its β (0.01–0.04) transfers. Flow models
            only.
        timestep_fraction (`float`, defaults to `0.6`): Fraction of the trainable steps (the first N−1, or the SDE
            window) trained per sample; the last step is never trained.
        timestep_selection (`str`, defaults to `"random"`): Which of them: `"random"`, drawn per sample (DanceGRPO);
            `"first"` or `"last"`, the earliest or latest (DanceGRPO's ablation: "first 30 %", "last 40 %").
        best_of_n_k (`int` or `None`, defaults to `None`): Train only the k highest and the k lowest advantages of
            each group (DanceGRPO's video recipe: 4 + 4 of 24); every process must hold whole groups. `None`: all.
        multi_objective_aggregation (`str`, defaults to `"sum_then_normalize"`): As in TRL. `"sum_then_normalize"`:
            the weighted sum of the rewards, then the advantage statistics of `scale_rewards`;
            `"normalize_then_sum"` (GDPO): each reward normalised in its group (std + 1e-4), weighted and summed,
            then normalised over the batch.
        scale_rewards (`str`, defaults to `"group"`): Advantage statistics. `"group"`: group mean and std
            (DanceGRPO); `"batch"`: group mean, batch std (Flow-GRPO); `"none"`: group mean only; `"per_prompt"`:
            DDPO's running mean and std of each prompt's last `per_prompt_buffer_size` rewards, or of the whole batch
            while a prompt has fewer than `per_prompt_min_count` (allows `num_generations=1`).
        per_prompt_buffer_size (`int`, defaults to `16`), per_prompt_min_count (`int`, defaults to `16`): DDPO's
            `per_prompt_stat_tracking.buffer_size` and `.min_count`.
        advantage_epsilon (`float` or `None`, defaults to `None`): Added to the std; `None`: 1e-8 (group), 1e-4
            (batch).
        adv_clip_max (`float`, defaults to `5.0`): Advantages are clipped to ±this.
        reward_weights (`list[float]` or `None`, defaults to `None`): Weights of the reward functions in the sum;
            `None`: all 1.
        video_reward_frames (`int` or `None`, defaults to `8`): Image rewards score videos on this many evenly spaced
            frames (first and last included) and average them; `None`: every frame. Rewards with
            `accepts_video = True` get whole videos.
        reward_kwargs (`dict` or `None`, defaults to `None`): Constructor arguments of registered model rewards, by
            name, e.g. `{"hpsv2": {"checkpoint": "/ckpt/HPS_v2.1_compressed.pt", "dtype": "bfloat16"}}` (a JSON
            string on the command line).
        log_completions_steps (`int`, defaults to `0`): Every this many optimizer steps (at the next rollout), send
            `num_completions_to_log` rollout images captioned with prompt and reward, and a histogram of the round's
            rewards, to the `report_to` trackers (TensorBoard, W&B, trackio). `0`: never.
        num_completions_to_log (`int`, defaults to `8`): Images per logging.
        reward_worker_thread (`bool`, defaults to `True`): Score each rollout chunk in a worker thread while the
            next chunk is denoised (with `rollout_batch_size` smaller than the local batch); results are identical.

        > Model

        model_init_kwargs (`dict` or `None`, defaults to `None`): Keyword arguments of
            `DiffusionPipeline.from_pretrained` when `model` is a string, e.g. `{"dtype": "bfloat16"}`.
        pipeline_class (`str` or `None`, defaults to `None`): A diffusers pipeline class to load `model` with instead
            of the one its `model_index.json` names, e.g. `"WanImageToVideoPipeline"` for image-to-video with
            Wan2.2-TI2V-5B.
        frozen_dtype, offload_text_encoders: memory settings of the VAE and text encoders, see
            [`~trl_dance.trainer.frozen_components.FrozenComponentsArguments`].
    """

    _VALID_DICT_FIELDS = [*_BaseConfig._VALID_DICT_FIELDS, "model_init_kwargs", "reward_kwargs"]

    # Overridden TrainingArguments defaults.
    learning_rate: float = field(
        default=1e-5, metadata={"help": "AdamW learning rate (DanceGRPO FLUX: 1e-5 full, 3e-4 LoRA)."}
    )
    lr_scheduler_type: str = field(
        default="constant", metadata={"help": "Learning-rate schedule (constant, as DanceGRPO, Flow-GRPO and DDPO)."}
    )
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient-norm clip."})
    per_device_train_batch_size: int = field(
        default=1, metadata={"help": "Transitions (denoising steps) per micro-batch per process."}
    )
    gradient_accumulation_steps: int = field(
        default=36, metadata={"help": "Micro-batches per optimizer update (default: 3 updates per 12×9 transitions)."}
    )
    logging_steps: float = field(default=1, metadata={"help": "Log every X optimizer updates."})
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of activation_checkpointing (diffusers' enable_gradient_checkpointing)."},
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep dataset columns besides `prompt`: they are passed to the rewards."}
    )

    # Generation
    num_generations: int = field(default=12, metadata={"help": "Samples per prompt (group size G)."})
    generation_batch_size: int | None = field(
        default=None, metadata={"help": "Samples per round over all processes (default: one group per process)."}
    )
    steps_per_generation: int | None = field(
        default=None, metadata={"help": "Derived: micro-batches per round. If set, must equal the derived value."}
    )
    rollout_batch_size: int | None = field(
        default=None, metadata={"help": "Samples denoised together per process (default: all local samples)."}
    )
    num_inference_steps: int = field(default=16, metadata={"help": "Denoising steps N."})
    height: int = field(default=720, metadata={"help": "Image height in pixels."})
    width: int = field(default=720, metadata={"help": "Image width in pixels."})
    num_frames: int | None = field(
        default=None, metadata={"help": "Frames per video (video pipelines; default: the family's, 81 for Wan)."}
    )
    guidance_scale: float = field(default=3.5, metadata={"help": "FLUX guidance embedding; SD3 CFG scale."})
    max_sequence_length: int = field(default=512, metadata={"help": "T5 prompt tokens."})
    negative_prompt: str | None = field(
        default=None, metadata={"help": "Prompt of the CFG unconditional branch (default: the pipeline's own)."}
    )
    train_expert: str = field(
        default="high_noise",
        metadata={"help": "Two-expert Wan 2.2: the expert trained.", "choices": ["high_noise", "low_noise"]},
    )
    guidance_scale_2: float | None = field(
        default=None,
        metadata={"help": "Two-expert Wan 2.2: CFG scale of the low-noise steps (default: guidance_scale)."},
    )
    offload_frozen_expert: bool = field(
        default=False, metadata={"help": "Two-expert Wan 2.2: keep the frozen expert on the CPU except in rollouts."}
    )
    sde_type: str = field(default="dance", metadata={"help": "dance | flow_grpo | cps.", "choices": list(_SDE_TYPES)})
    eta: float = field(default=0.3, metadata={"help": "SDE noise level (> 0)."})
    sigma_schedule: str = field(
        default="dance", metadata={"help": "dance | pipeline.", "choices": ["dance", "pipeline"]}
    )
    shift: float = field(default=3.0, metadata={"help": "Shift of the dance sigma schedule."})
    share_initial_noise: str = field(
        default="group",
        metadata={"help": "group | none: initial noise shared within a group.", "choices": ["group", "none"]},
    )
    log_prob_reduction: str = field(default="mean", metadata={"help": "mean | sum.", "choices": ["mean", "sum"]})
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

    # Optimization
    num_iterations: int = field(default=1, metadata={"help": "Passes over each round's transitions."})
    epsilon: float = field(default=1e-4, metadata={"help": "PPO clip range."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip range (None: epsilon)."})
    ratio_normalization: bool = field(default=False, metadata={"help": "GRPO-Guard ratio normalisation."})
    step_reweighting: bool = field(default=False, metadata={"help": "GRPO-Guard 1/Δσ step reweighting."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient to the reference model (0: no KL)."})
    kl_scaling: str = field(
        default="gaussian",
        metadata={
            "help": "gaussian (exact KL) | flow_grpo (exact KL × Δσ, Flow-GRPO's units).",
            "choices": ["gaussian", "flow_grpo"],
        },
    )
    timestep_fraction: float = field(
        default=0.6, metadata={"help": "Fraction of the trainable steps (first N-1, or the window) trained."}
    )
    timestep_selection: str = field(
        default="random",
        metadata={"help": "random | first | last trainable steps.", "choices": ["random", "first", "last"]},
    )
    best_of_n_k: int | None = field(
        default=None, metadata={"help": "Train only the k highest and k lowest advantages of each group."}
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "sum_then_normalize | normalize_then_sum (GDPO).",
            "choices": ["sum_then_normalize", "normalize_then_sum"],
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={"help": "group | batch | none | per_prompt.", "choices": [*DEFAULT_EPSILON, "per_prompt"]},
    )
    per_prompt_buffer_size: int = field(default=16, metadata={"help": "DDPO per-prompt stat tracking buffer."})
    per_prompt_min_count: int = field(default=16, metadata={"help": "DDPO per-prompt stat tracking min count."})
    advantage_epsilon: float | None = field(default=None, metadata={"help": "Added to the std (default by mode)."})
    adv_clip_max: float = field(default=5.0, metadata={"help": "Advantage clip."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "Weights of the reward functions."})
    video_reward_frames: int | None = field(
        default=8, metadata={"help": "Frames of each video an image reward scores and averages (None: all)."}
    )
    reward_kwargs: dict[str, dict[str, Any]] | str | None = field(
        default=None, metadata={"help": "Constructor arguments of registered model rewards, by reward name (JSON)."}
    )
    log_completions_steps: int = field(
        default=0, metadata={"help": "Log rollout images and a reward histogram every this many steps (0: never)."}
    )
    num_completions_to_log: int = field(default=8, metadata={"help": "Images per rollout logging."})
    reward_worker_thread: bool = field(
        default=True, metadata={"help": "Score rollout chunks in a worker thread while the next chunk is sampled."}
    )

    # Model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments of DiffusionPipeline.from_pretrained."}
    )
    pipeline_class: str | None = field(
        default=None,
        metadata={"help": "Diffusers pipeline class to load the model with (default: its model_index.json's)."},
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_frozen_components()
        _choice("sde_type", self.sde_type, _SDE_TYPES)
        _choice("sigma_schedule", self.sigma_schedule, ("dance", "pipeline"))
        _choice("share_initial_noise", self.share_initial_noise, ("group", "none"))
        _choice("scale_rewards", self.scale_rewards, (*DEFAULT_EPSILON, "per_prompt"))
        _choice("log_prob_reduction", self.log_prob_reduction, ("mean", "sum"))
        _choice("train_expert", self.train_expert, ("high_noise", "low_noise"))
        _choice("kl_scaling", self.kl_scaling, ("gaussian", "flow_grpo"))
        _choice("sde_window_schedule", self.sde_window_schedule, ("random", "progressive"))
        _choice("post_window_solver", self.post_window_solver, ("ode", "dpm_solver++"))
        _choice("timestep_selection", self.timestep_selection, ("random", "first", "last"))
        _choice("multi_objective_aggregation", self.multi_objective_aggregation, _AGGREGATIONS)
        if self.num_generations < (1 if self.scale_rewards == "per_prompt" else 2):
            raise ValueError(
                f"num_generations must be >= 2 for group statistics (or scale_rewards='per_prompt'), got {self.num_generations}"
            )
        if self.num_inference_steps < 2:
            raise ValueError(
                f"num_inference_steps must be >= 2 (the last step is never trained), got {self.num_inference_steps}"
            )
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.eta <= 0:
            raise ValueError(f"eta must be > 0: a deterministic step has no log-probability, got {self.eta}")
        for name, value, ok, bound in (
            ("epsilon", self.epsilon, self.epsilon > 0, "> 0"),
            ("beta", self.beta, self.beta >= 0, ">= 0"),
            ("num_iterations", self.num_iterations, self.num_iterations >= 1, ">= 1"),
            ("height", self.height, self.height > 0, "> 0"),
            ("width", self.width, self.width > 0, "> 0"),
            ("num_frames", self.num_frames, self.num_frames is None or self.num_frames > 0, "> 0 (or None)"),
        ):
            if not ok or not math.isfinite(value or 0):
                raise ValueError(f"{name} must be {bound}, got {value}")

        self._check_cheaper_rollouts()
        num_processes = self.world_size
        if self.generation_batch_size is None:
            self.generation_batch_size = self.num_generations * num_processes
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) must be a multiple of num_generations "
                f"({self.num_generations})"
            )
        if self.generation_batch_size % num_processes:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) must be divisible by the number of processes "
                f"({num_processes})"
            )
        if self.best_of_n_k is not None and self.per_device_generation_batch_size % self.num_generations:
            raise ValueError(
                f"best_of_n_k selects within whole groups, but each process holds {self.per_device_generation_batch_size} "
                f"samples, not a multiple of num_generations ({self.num_generations}); make generation_batch_size a "
                f"multiple of num_generations × the {num_processes} processes"
            )
        transitions = self.per_device_trained_samples * self.timesteps_per_sample
        if transitions % self.per_device_train_batch_size:
            raise ValueError(
                f"each process trains {self.per_device_trained_samples} samples × {self.timesteps_per_sample} "
                f"steps = {transitions} transitions per round, which per_device_train_batch_size "
                f"({self.per_device_train_batch_size}) must divide"
            )
        derived = transitions // self.per_device_train_batch_size
        if self.steps_per_generation is not None and self.steps_per_generation != derived:
            raise ValueError(
                f"steps_per_generation={self.steps_per_generation} contradicts the derived value {derived} "
                f"(= {transitions} transitions per process per round / per_device_train_batch_size); leave it unset"
            )
        self.steps_per_generation = derived
        round_steps = derived * self.num_iterations
        if round_steps % self.gradient_accumulation_steps:
            divisors = [d for d in range(1, round_steps + 1) if round_steps % d == 0]
            raise ValueError(
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) must divide the {round_steps} "
                f"micro-batches of a round (steps_per_generation {derived} × num_iterations {self.num_iterations}): "
                f"otherwise an optimizer update mixes transitions of two rounds' rollouts. Divisors: {divisors}"
            )
        if self.video_reward_frames is not None and self.video_reward_frames < 1:
            raise ValueError(f"video_reward_frames must be >= 1 or None, got {self.video_reward_frames}")
        if self.rollout_batch_size is not None and self.rollout_batch_size < 1:
            raise ValueError(f"rollout_batch_size must be >= 1, got {self.rollout_batch_size}")

    def _check_cheaper_rollouts(self) -> None:
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
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ValueError(f"epsilon_high must be > 0 (or None), got {self.epsilon_high}")
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
        if self.multi_objective_aggregation == "normalize_then_sum" and self.scale_rewards == "per_prompt":
            raise ValueError(
                "multi_objective_aggregation='normalize_then_sum' normalises each reward in its group; "
                "scale_rewards='per_prompt' has no groups. Use one or the other"
            )

    @property
    def per_device_trained_samples(self) -> int:
        """Samples of each process whose transitions are trained per round (2k per group with ``best_of_n_k``)."""
        local = self.per_device_generation_batch_size
        if self.best_of_n_k is None:
            return local
        return local // self.num_generations * 2 * self.best_of_n_k

    @property
    def per_device_generation_batch_size(self) -> int:
        """Samples each process generates per round."""
        return self.generation_batch_size // self.world_size

    @property
    def timesteps_per_sample(self) -> int:
        """K: transitions trained per sample, of the first N−1 steps or of the SDE window."""
        steps = self.num_inference_steps - 1 if self.sde_window_size is None else self.sde_window_size
        # The tolerance keeps e.g. 15 × 0.6 at 9 whatever the float rounding.
        return max(1, math.floor(steps * self.timestep_fraction + 1e-9))


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
