"""The configuration shared by the online RL trainers: rollouts from the policy, rewards, advantages, model."""

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..advantages import DEFAULT_EPSILON
from ..rewards.base import MODALITIES
from .async_rounds import AsyncRoundsArguments
from .diffusion_config import DiffusionTrainingConfig

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum", "group_normalize_then_sum")


@dataclass
class RolloutConfig(AsyncRoundsArguments, DiffusionTrainingConfig):
    r"""
    What every online RL trainer of diffusion models shares: each round, the policy generates
    `generation_batch_size` samples (groups of `num_generations` per prompt), the rewards score them and become
    advantages, and the round's *training items* (GRPO: denoising transitions; DiffusionNFT: noised copies of the
    samples) are shuffled into micro-batches of `per_device_train_batch_size`, one per `training_step`. Field names
    follow [`trl.GRPOConfig`] where the meaning is the same.

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
            loss then goes through the CFG-combined prediction (1 disables CFG). Z-Image: its pipeline's scale,
            CFG ``c + s (c − u)`` when above 0 (Z-Image-Turbo: 0).
        max_sequence_length (`int`, defaults to `512`): T5 tokens of the prompt.
        negative_prompt (`str` or `None`, defaults to `None`): The prompt of CFG's unconditional branch (with CFG
            only). `None`: the pipeline's own unconditional embedding (the empty prompt; zeros for SDXL base).
        train_expert (`str`, defaults to `"high_noise"`): Two-expert pipelines (Wan 2.2 A14B): the expert trained,
            `"high_noise"` (`transformer`, the steps with timestep >= boundary_ratio · 1000) or `"low_noise"`
            (`transformer_2`); the other serves its steps frozen, and the K transitions of each sample are drawn
            among the trained expert's steps.
        guidance_scale_2 (`float` or `None`, defaults to `None`): Two-expert pipelines: the CFG scale of the
            low-noise expert's steps. `None`: `guidance_scale`.
        pipeline_kwargs (`dict` or `None`, defaults to `None`): Arguments of the pipeline's `__call__` that the
            family's policy reproduces beyond the fields above, by the pipeline's names (a JSON string on the command
            line); unset ones keep the pipeline's defaults. LTX-2: `frame_rate`, `stg_scale`, `modality_scale`,
            `guidance_rescale`, their `audio_*` counterparts, `spatio_temporal_guidance_blocks`, `use_cross_timestep`,
            `motion_speed`. Other families take none.
        offload_frozen_expert (`bool`, defaults to `False`): Two-expert pipelines: keep the frozen expert on the CPU
            except during rollouts, one transfer each way per round, so training does not hold it (Wan 2.2 A14B:
            28 GB in bf16).
        sigma_schedule (`str`, defaults to `"dance"`): `"dance"`: σ_k = s·u/(1+(s−1)u) with `shift`; `"pipeline"`:
            the σ the pipeline itself samples with (FLUX: linspace(1, 1/N) with its resolution-dependent shift; SD3,
            Wan: its scheduler's static shift).
        shift (`float`, defaults to `3.0`): Shift s of the `"dance"` schedule.
        share_initial_noise (`str`, defaults to `"group"`): `"group"`: the G samples of a prompt start from the same
            noise; `"none"`: every sample has its own.

        > Rewards, advantages, training

        gradient_accumulation_steps (`int` or `None`, defaults to `None`): Micro-batches per optimizer update; it
            must divide a round's `steps_per_generation · num_iterations` micro-batches (an update never mixes two
            rounds). `None`: the smallest divisor giving at most the method's documented updates per round
            (DanceGRPO 3, DiffusionNFT 1; one update per micro-batch for the others).
        num_iterations (`int`, defaults to `1`): Passes over each round's training items (μ in GRPO).
        beta (`float`, defaults to `0.0`): KL coefficient to the reference (the model with LoRA disabled, or a
            frozen copy for full fine-tuning). 0 disables the KL term and its extra forward pass.
        multi_objective_aggregation (`str`, defaults to `"sum_then_normalize"`): As in TRL. `"sum_then_normalize"`:
            the weighted sum of the rewards, then the advantage statistics of `scale_rewards`;
            `"normalize_then_sum"` (GDPO): each reward normalised in its group (std + 1e-4), weighted and summed,
            then normalised over the batch (TRL's; not MixGRPO's, which does not renormalise);
            `"group_normalize_then_sum"`: each reward normalised in its group (std + 1e-8), weighted and summed, no
            renormalisation (MixGRPO's `advantage_aggr`, DanceGRPO's video VQ + MQ advantages).
        scale_rewards (`str` or `bool`, defaults to `"group"`): Advantage statistics (TRL's `True` is `"group"`, `False`
            `"none"`). `"group"`: group mean and std
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
        reward_modalities (`list[str]` or `None`, defaults to `None`): What each reward judges on audio-video families
            (LTX-2): `"video"`, `"audio"` or `"both"` (OmniNFT's routing, ALGORITHMS-NEXT §2.17.5). Each stream then
            trains on the advantages of the rewards routed to it alone (the configured aggregation over them), and a
            stream no reward judges is not trained by any; `None`: each reward's own `modality` attribute, else
            `"both"` (one advantage for every stream, as without routing). DanceGRPO and DiffusionNFT (`loss_type:
            nft`).
        video_reward_frames (`int` or `None`, defaults to `8`): Image rewards score videos on this many evenly spaced
            frames (first and last included) and average them; `None`: every frame. Rewards with
            `accepts_video = True` get whole videos.
        reward_kwargs (`dict` or `None`, defaults to `None`): Constructor arguments of registered model rewards, by
            name, e.g. `{"hpsv2": {"checkpoint": "/ckpt/HPS_v2.1_compressed.pt", "dtype": "bfloat16"}}` (a JSON
            string on the command line).
        probe_rewards (`bool`, defaults to `False`): Call every reward and held-out judge once when the trainer is
            built, on 2 random images (videos) of the configured size with the first prompts and columns of the
            dataset, so that a reward that raises stops the run before the first rollout, naming it. Audio rewards
            are not probed. `False` skips it (a reward that counts its calls, or one too costly to call twice).
        log_completions_steps (`int`, defaults to `0`): Every this many optimizer steps (at the next rollout), send
            `num_completions_to_log` rollout images captioned with prompt and reward, and a histogram of the round's
            rewards, to the `report_to` trackers (TensorBoard, W&B, trackio). `0`: never.
        num_completions_to_log (`int`, defaults to `8`): Images per logging.
        max_idle_rounds (`int`, defaults to `3`): A round in which no training item can contribute a gradient (every
            advantage zero, every pair masked, every hinge inactive) or every update's gradient is exactly zero logs a
            warning naming the cause and the field to change; this many such rounds in a row stop training with it.
            0: warn only.
        reward_worker_thread (`bool`, defaults to `True`): Score each rollout chunk in a worker thread while the
            next chunk is denoised (with `rollout_batch_size` smaller than the local batch); results are identical.
        max_staleness, importance_sampling_correction, importance_sampling_mode, importance_sampling_clip_max,
            importance_sampling_clip_min: asynchronous rounds (rewards of a round scored while the next rounds roll out
            and train), see [`~trl_dance.trainer.async_rounds.AsyncRoundsArguments`].

        > Evaluation (`eval_dataset`, `eval_strategy`, `eval_steps`, `per_device_eval_batch_size` as in TRL)

        eval_num_generations (`int`, defaults to `1`): Samples per evaluation prompt, from the deterministic sampler.
        eval_reward_funcs (`list[str]` or `None`, defaults to `None`): Held-out judges, scored at evaluation only and
            never trained on (e.g. `["ocr_easyocr"]` beside an `ocr` reward): logged as
            `eval_judges/<name>/mean`, with what they log through `log_metric`. Names as in `reward_funcs`; their
            constructor arguments in `reward_kwargs`.
        eval_seed, eval_num_inference_steps, eval_guidance_scale, eval_negative_prompt: the evaluation sampler's
            noise seed and settings (default: training's), see
            [`~trl_dance.trainer.evaluation.EvaluationArguments`].

        > Model

        merge_lora (`list[str]` or `None`, defaults to `None`): LoRA folders in the diffusers format (what every
            trainer here saves) fused into the base weights, in order, before training: training starts from the
            merged model, which is also the reference (LoRA disabled). RL on a student distilled here (RTDMD's
            `merge_before_training`), or on any fine-tune.
        model_init_kwargs (`dict` or `None`, defaults to `None`): Keyword arguments of
            `DiffusionPipeline.from_pretrained` when `model` is a string, e.g. `{"dtype": "bfloat16"}`.
        pipeline_class (`str` or `None`, defaults to `None`): A diffusers pipeline class to load `model` with instead
            of the one its `model_index.json` names, e.g. `"WanImageToVideoPipeline"` for image-to-video with
            Wan2.2-TI2V-5B.
        frozen_dtype, offload_text_encoders: memory settings of the VAE and text encoders, see
            [`~trl_dance.trainer.frozen_components.FrozenComponentsArguments`].
        use_ema, ema_decay: an EMA of the trained parameters, see [`~trl_dance.trainer.ema.EMAArguments`].
        context_parallel_size, context_parallel_type: split each sample's token sequence over groups of processes
            (videos at full size), see [`~trl_dance.trainer.context_parallel.ContextParallelArguments`].
    """

    min_generations = 2  # group statistics need two samples; a method without advantages lowers it
    # With gradient_accumulation_steps unset: at most this many optimizer updates per round, as many as divide the
    # round's micro-batches (None: one update per micro-batch). Each method documents its own.
    updates_per_round: ClassVar[int | None] = None

    _VALID_DICT_FIELDS = [*DiffusionTrainingConfig._VALID_DICT_FIELDS, "reward_kwargs", "pipeline_kwargs"]

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
        default=1, metadata={"help": "Training items (GRPO: transitions) per micro-batch per process."}
    )
    gradient_accumulation_steps: int | None = field(
        default=None,
        metadata={"help": "Micro-batches per optimizer update (None: derived, see `updates_per_round`)."},
    )
    logging_steps: float = field(default=1, metadata={"help": "Log every X optimizer updates."})
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of activation_checkpointing (diffusers' enable_gradient_checkpointing)."},
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep dataset columns besides `prompt`: they are passed to the rewards."}
    )
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
    pipeline_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Family-specific arguments of the pipeline's __call__ the policy reproduces (LTX-2: JSON)."},
    )
    offload_frozen_expert: bool = field(
        default=False, metadata={"help": "Two-expert Wan 2.2: keep the frozen expert on the CPU except in rollouts."}
    )
    sigma_schedule: str = field(
        default="dance", metadata={"help": "dance | pipeline.", "choices": ["dance", "pipeline"]}
    )
    shift: float = field(default=3.0, metadata={"help": "Shift of the dance sigma schedule."})
    share_initial_noise: str = field(
        default="group",
        metadata={"help": "group | none: initial noise shared within a group.", "choices": ["group", "none"]},
    )
    num_iterations: int = field(default=1, metadata={"help": "Passes over each round's training items."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient to the reference model (0: no KL)."})
    scale_rewards: str = field(
        default="group",
        metadata={"help": "group | batch | none | per_prompt.", "choices": [*DEFAULT_EPSILON, "per_prompt"]},
    )
    per_prompt_buffer_size: int = field(default=16, metadata={"help": "DDPO per-prompt stat tracking buffer."})
    per_prompt_min_count: int = field(default=16, metadata={"help": "DDPO per-prompt stat tracking min count."})
    advantage_epsilon: float | None = field(default=None, metadata={"help": "Added to the std (default by mode)."})
    adv_clip_max: float = field(default=5.0, metadata={"help": "Advantage clip."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "Weights of the reward functions."})
    reward_modalities: list[str] | None = field(
        default=None,
        metadata={
            "help": "What each reward judges on audio-video families: video | audio | both (routes advantages)."
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "sum_then_normalize | normalize_then_sum (GDPO) | group_normalize_then_sum (MixGRPO).",
            "choices": list(AGGREGATIONS),
        },
    )
    video_reward_frames: int | None = field(
        default=8, metadata={"help": "Frames of each video an image reward scores and averages (None: all)."}
    )
    reward_kwargs: dict[str, dict[str, Any]] | str | None = field(
        default=None, metadata={"help": "Constructor arguments of registered model rewards, by reward name (JSON)."}
    )
    probe_rewards: bool = field(
        default=False, metadata={"help": "Call every reward once on random images at construction (fail early)."}
    )
    log_completions_steps: int = field(
        default=0, metadata={"help": "Log rollout images and a reward histogram every this many steps (0: never)."}
    )
    num_completions_to_log: int = field(default=8, metadata={"help": "Images per rollout logging."})
    max_idle_rounds: int = field(
        default=3, metadata={"help": "Rounds in a row that train nothing before training stops (0: warn only)."}
    )
    reward_worker_thread: bool = field(
        default=True, metadata={"help": "Score rollout chunks in a worker thread while the next chunk is sampled."}
    )
    eval_num_generations: int = field(default=1, metadata={"help": "Evaluation samples per prompt."})
    eval_reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "Held-out judges scored at evaluation only (never trained on)."}
    )
    pipeline_class: str | None = field(
        default=None,
        metadata={"help": "Diffusers pipeline class to load the model with (default: its model_index.json's)."},
    )

    def __post_init__(self):
        super().__post_init__()
        _choice("sigma_schedule", self.sigma_schedule, ("dance", "pipeline"))
        _choice("share_initial_noise", self.share_initial_noise, ("group", "none"))
        if str(self.scale_rewards).lower() in ("true", "false"):  # TRL's booleans: True is "group", False "none"
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"
        _choice("scale_rewards", self.scale_rewards, (*DEFAULT_EPSILON, "per_prompt"))
        _choice("train_expert", self.train_expert, ("high_noise", "low_noise"))
        _choice("multi_objective_aggregation", self.multi_objective_aggregation, AGGREGATIONS)
        if self.num_generations < (1 if self.scale_rewards == "per_prompt" else self.min_generations):
            raise ValueError(
                f"num_generations must be >= 2 for group statistics (or scale_rewards='per_prompt'), got {self.num_generations}"
            )
        if self.num_inference_steps < 2:
            raise ValueError(
                f"num_inference_steps must be >= 2 (the last step is never trained), got {self.num_inference_steps}"
            )
        for name, value, ok, bound in (
            ("beta", self.beta, self.beta >= 0, ">= 0"),
            ("num_iterations", self.num_iterations, self.num_iterations >= 1, ">= 1"),
            ("max_idle_rounds", self.max_idle_rounds, self.max_idle_rounds >= 0, ">= 0"),
            ("height", self.height, self.height > 0, "> 0"),
            ("width", self.width, self.width > 0, "> 0"),
            ("num_frames", self.num_frames, self.num_frames is None or self.num_frames > 0, "> 0 (or None)"),
        ):
            if not ok or not math.isfinite(value or 0):
                raise ValueError(f"{name} must be {bound}, got {value}")
        if self.multi_objective_aggregation != "sum_then_normalize" and self.scale_rewards == "per_prompt":
            raise ValueError(
                f"multi_objective_aggregation={self.multi_objective_aggregation!r} normalises each reward in its group; "
                "scale_rewards='per_prompt' has no groups. Use one or the other"
            )
        for modality in self.reward_modalities or []:
            _choice("reward_modalities", modality, MODALITIES)
        if self.video_reward_frames is not None and self.video_reward_frames < 1:
            raise ValueError(f"video_reward_frames must be >= 1 or None, got {self.video_reward_frames}")
        if self.eval_num_generations < 1:
            raise ValueError(f"eval_num_generations must be >= 1, got {self.eval_num_generations}")
        if self.rollout_batch_size is not None and self.rollout_batch_size < 1:
            raise ValueError(f"rollout_batch_size must be >= 1, got {self.rollout_batch_size}")

        num_processes = self.data_parallel_size  # a context-parallel group is one virtual process
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
                f"({num_processes}" + (" data-parallel groups)" if self.context_parallel_size > 1 else ")")
            )
        self._check_async_rounds()
        self._check_method()
        items, description = self._round_items()
        if items % self.per_device_train_batch_size:
            raise ValueError(
                f"each process trains {description} per round, which per_device_train_batch_size "
                f"({self.per_device_train_batch_size}) must divide: set per_device_train_batch_size to one of "
                f"{_divisors(items)}, or change generation_batch_size"
            )
        derived = items // self.per_device_train_batch_size
        if self.steps_per_generation is not None and self.steps_per_generation != derived:
            raise ValueError(
                f"steps_per_generation={self.steps_per_generation} contradicts the derived value {derived} "
                f"(= {items} training items per process per round / per_device_train_batch_size); leave it unset"
            )
        self.steps_per_generation = derived
        round_steps = derived * self.num_iterations
        if self.gradient_accumulation_steps is None:
            # The fewest micro-batches per update that give at most `updates_per_round` updates.
            most = self.updates_per_round or round_steps
            self.gradient_accumulation_steps = next(d for d in _divisors(round_steps) if round_steps // d <= most)
        if self.gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be >= 1 (or None), got {self.gradient_accumulation_steps}"
            )
        if round_steps % self.gradient_accumulation_steps:
            divisors = _divisors(round_steps)
            raise ValueError(
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) must divide the {round_steps} "
                f"micro-batches of a round (steps_per_generation {derived} × num_iterations {self.num_iterations}): "
                f"otherwise an optimizer update mixes items of two rounds' rollouts. Divisors: {divisors} "
                f"({round_steps} makes one update per round)"
            )

    def _check_method(self) -> None:
        """The method's own checks, after the generation batch is known."""

    def _round_items(self) -> tuple[int, str]:
        """Training items per process per round, and how they are counted (for errors)."""
        raise NotImplementedError

    def _check_whole_groups(self, what: str, **counts: int) -> None:
        """Raise unless each of ``counts`` (``generation_batch_size / num_processes`` always among them) is a multiple
        of ``num_generations``: ``what`` needs every group whole on one process (and in one micro-batch)."""
        counts = {"generation_batch_size / num_processes": self.per_device_generation_batch_size, **counts}
        for name, value in counts.items():
            if value % self.num_generations:
                raise ValueError(
                    f"{what} whole groups: {name} ({value}) must be a multiple of num_generations "
                    f"({self.num_generations}); with {self.data_parallel_size} processes, generation_batch_size must be "
                    f"a multiple of num_generations × {self.data_parallel_size}"
                )

    def sde_settings(self) -> dict[str, Any]:
        """The policy's SDE settings this config sets (none: the sampler's defaults; rollouts without log-probabilities
        step deterministically)."""
        return {}

    @property
    def per_device_generation_batch_size(self) -> int:
        """Samples each process generates per round."""
        return self.generation_batch_size // self.data_parallel_size

    @property
    def round_micro_steps(self) -> int:
        """``training_step`` calls per round: its micro-batches times ``num_iterations``."""
        return self.steps_per_generation * self.num_iterations

    @property
    def optimizer_updates_per_round(self) -> int:
        """Optimizer updates per round (``gradient_accumulation_steps`` divides the round's micro-steps)."""
        return self.round_micro_steps // self.gradient_accumulation_steps


SDE_TYPES = ("dance", "flow_grpo", "cps", "flash")


@dataclass
class SDEArguments:
    """The stochastic step of the methods that train on its log-probabilities (documented in
    :class:`~trl_dance.DanceGRPOConfig`); the policy's sampler reads these names unchanged (:meth:`sde_settings`)."""

    sde_type: str = field(
        default="dance", metadata={"help": "dance | flow_grpo | cps | flash.", "choices": list(SDE_TYPES)}
    )
    eta: float = field(default=0.3, metadata={"help": "SDE noise level (> 0)."})
    log_prob_reduction: str = field(default="mean", metadata={"help": "mean | sum.", "choices": ["mean", "sum"]})

    def _check_sde(self, zero_eta: str) -> None:
        """Raise on an unknown choice or ``eta <= 0`` (``zero_eta`` says why a method needs noise)."""
        _choice("sde_type", self.sde_type, SDE_TYPES)
        _choice("log_prob_reduction", self.log_prob_reduction, ("mean", "sum"))
        if not (self.eta > 0 and math.isfinite(self.eta)):
            raise ValueError(f"eta must be > 0: {zero_eta}, got {self.eta}")

    def sde_settings(self) -> dict[str, Any]:
        return {"sde_type": self.sde_type, "eta": self.eta, "log_prob_reduction": self.log_prob_reduction}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
