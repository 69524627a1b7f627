"""The engine of the online RL trainers: rollouts from the policy, rewards, advantages, rounds of micro-batches.

A subclass says how a round is sampled (:meth:`RolloutTrainer.rollout_plan`), what it keeps of the rollout and
how it splits it into micro-batches (:meth:`RolloutTrainer._plan_round`), and the loss of one micro-batch.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from PIL import Image
from torch.utils.data import Sampler
from transformers import TrainerCallback, TrainerState

from .._compat import repeat_iterable_dataset
from ..advantages import PerPromptStatTracker, group_advantages, nan_std, normalized_reward_sum
from ..data import text_prompts
from ..policies import DiffusionPolicy, SamplerSettings, make_policy
from ..rewards import RewardFunc, resolve_reward_funcs, reward_name, score_images, weighted_reward_sum
from ..rewards.base import RewardError, reward_modality
from ..rollout_service import trainable_tensors
from ..sampling import RolloutPlan, generate, group_generators, mix_seed, sample_generators
from .async_rounds import RoundRecord, RoundRows, rounds_in_run
from .context_parallel import STREAMING_WITH_CONTEXT_PARALLEL, GroupReplicatedSampler
from .diffusion_trainer import DiffusionTrainer, EpochSeededRepeatSampler, load_pipeline
from .evaluation import evaluation_policy, sampling_record
from .media import log_rollout_media
from .memory_advice import named_out_of_memory
from .progress import use_round_progress
from .reward_metrics import RewardMetricLog
from .rollout_config import RolloutConfig
from .rollout_workers import RemoteRollouts
from .training_signal import TrainingSignal


def _identity(rows: list[dict]) -> list[dict]:
    return rows


_GROUP = "__group__"  # an evaluation row's group (its prompt's index), for group-wise rewards


def _columns(dataset: Dataset | IterableDataset) -> list[str]:
    """A dataset's columns; for a stream whose features are not declared, its first row's keys."""
    return dataset.column_names if dataset.column_names is not None else list(next(iter(dataset)))


def _timed(score: Callable[[], torch.Tensor], seconds: list[float]) -> torch.Tensor:
    """``score()``, appending its wall time to ``seconds`` (run in the reward worker)."""
    start = time.perf_counter()
    try:
        return score()
    finally:
        seconds.append(time.perf_counter() - start)


def _fingerprint(value: Any) -> Any:
    """A hashable identity of a conditioning value: the content of a PIL image, else the value itself."""
    if isinstance(value, Image.Image):
        return value.mode, value.size, hashlib.sha1(value.tobytes()).hexdigest()
    return value


class RolloutTrainer(DiffusionTrainer):
    """Rounds of rollouts and training for a diffusers pipeline (see the module docstring).

    Args:
        model: a Hub id or local folder of a diffusers pipeline, or a pipeline instance (FLUX, SD3, SD1.x/2.x, SDXL,
            Wan).
        reward_funcs: a reward or a list of rewards, each a callable
            ``f(prompts: list[str], images: Tensor (B, 3, H, W) in [0, 1], **columns) -> list[float]``, a registered
            name (``"brightness"``) or ``"module.path:function"``. Extra dataset columns are passed as keyword lists.
            Video models: see ``video_reward_frames`` in the config (frame-wise scoring, or whole videos for rewards
            with ``accepts_video = True``).
        args: the configuration.
        train_dataset: a ``datasets.Dataset`` with a ``prompt`` column.
        eval_dataset: held-out prompts (a ``prompt`` column, and the policy's condition columns), scored by
            :meth:`evaluate` at ``eval_steps``.
        callbacks, optimizers: as in ``transformers.Trainer``.
        peft_config: a ``peft.LoraConfig`` to train a LoRA (saved in the diffusers format); ``None`` trains the
            whole denoiser. Last, as in ``trl.GRPOTrainer``.
    """

    config_class: type[RolloutConfig] = RolloutConfig
    supports_async_rounds = False  # whether the method trains correctly on rounds sampled by older weights
    _synchronous_reason = "this method runs synchronous rounds only"

    def __init__(
        self,
        model: str | DiffusionPipeline,
        reward_funcs: RewardFunc | str | Sequence[RewardFunc | str],
        args: RolloutConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        peft_config: LoraConfig | None = None,
    ):
        args = self._resolve_args(model, args, self.config_class, self._name)

        # Rewards receive every column but the prompt (which arrives as ``prompts``).
        columns = [c for c in _columns(train_dataset) if c != "prompt"] if train_dataset is not None else None
        if isinstance(reward_funcs, str) or callable(reward_funcs):
            reward_funcs = [reward_funcs]
        if not reward_funcs:
            raise ValueError("at least one reward function is required")
        judges = list(args.eval_reward_funcs or [])
        funcs = resolve_reward_funcs([*reward_funcs, *judges], args.reward_kwargs or {}, columns)
        self.reward_funcs, self.eval_judges = funcs[: len(reward_funcs)], funcs[len(reward_funcs) :]
        self.reward_names = [reward_name(func) for func in self.reward_funcs]
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ValueError(f"{len(weights)} reward_weights for {len(self.reward_funcs)} reward functions")
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        groupwise = [reward_name(f) for f in self.reward_funcs if getattr(f, "groupwise", False)]
        local = args.per_device_generation_batch_size
        if groupwise and (local % args.num_generations or (args.rollout_batch_size or local) % args.num_generations):
            raise ValueError(
                f"group-wise rewards {groupwise} score whole groups: each process's samples per round ({local}) and "
                f"rollout_batch_size ({args.rollout_batch_size}) must be multiples of num_generations "
                f"({args.num_generations})"
            )
        self._check_dataset(train_dataset, args)
        if args.rollout_server_urls:
            refusals = {
                self._synchronous_reason: not self.supports_async_rounds,
                "rollout workers receive a LoRA (peft_config); full fine-tuning is not supported yet": peft_config
                is None,
                "rollout workers serve single-process rollouts; context_parallel_size > 1 is not supported yet": (
                    args.context_parallel_size > 1
                ),
            }
            for why, refused in refusals.items():
                if refused:
                    raise ValueError(f"rollout_server_urls: {why}")
        if args.max_staleness:
            if not self.supports_async_rounds:
                raise ValueError(f"max_staleness > 0: {self._synchronous_reason}; set max_staleness 0")
            if isinstance(train_dataset, IterableDataset):
                raise ValueError(
                    "max_staleness > 0 launches rounds ahead of the data loader, drawing their prompts from the sampler's "
                    "order: it needs a map-style train_dataset, not a stream"
                )
        train_dataset = text_prompts(train_dataset)
        if eval_dataset is not None:
            if not isinstance(eval_dataset, (Dataset, IterableDataset)) or "prompt" not in _columns(eval_dataset):
                raise ValueError("eval_dataset must be a datasets.Dataset or IterableDataset with a 'prompt' column")
            eval_dataset = text_prompts(eval_dataset)
        if isinstance(train_dataset, IterableDataset):
            # As trl.GRPOTrainer: the prompt repeats are baked into the stream, which each process then shards into
            # contiguous slices itself (dispatching would collate the string column on the main process), read by
            # one worker so that groups are not interleaved.
            if args.accelerator_config.dispatch_batches:
                raise ValueError("a streaming train_dataset needs accelerator_config.dispatch_batches=False")
            args.accelerator_config.dispatch_batches = False
            args.dataloader_num_workers = 0

        policy = make_policy(load_pipeline(model, args, args.pipeline_class), SamplerSettings.from_config(args))
        if args.offload_frozen_expert and policy.frozen_expert is None:
            raise ValueError(
                f"offload_frozen_expert applies to two-expert pipelines (Wan 2.2 A14B); {type(policy.pipeline).__name__} "
                "has one denoiser"
            )
        policy.runtime.offload_frozen_expert = args.offload_frozen_expert
        self._check_policy(policy, args)
        audio = [reward_name(f) for f in self.reward_funcs if getattr(f, "accepts_audio", False)]
        if audio and not policy.has_audio:
            raise ValueError(f"rewards {audio} score audio, which {type(policy.pipeline).__name__} does not generate")
        self._decode_audio = bool(audio)  # the soundtracks are decoded only for rewards that score them
        self.reward_routes = self._reward_routes(policy, args)
        if args.probe_rewards and train_dataset is not None:
            self._probe_rewards(policy, train_dataset, args.video_reward_frames)
        if train_dataset is not None:  # (Qwen-Image 2.1 conditions on an image column where the rows have one)
            policy.use_condition_columns(_columns(train_dataset))
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            missing = [c for c in policy.condition_columns if dataset is not None and c not in _columns(dataset)]
            if missing:
                raise ValueError(
                    f"{type(policy.pipeline).__name__} conditions every sample on the dataset columns {missing} (PIL "
                    f"images or paths: the first frame for image-to-video, the source image for editing); {name} has "
                    f"{_columns(dataset)}"
                )
        super().__init__(
            policy,
            args,
            peft_config,
            need_reference=self._needs_reference(args),  # full fine-tuning then keeps a frozen copy
            ref_model=self._reference_model(policy, args, peft_config),
            data_collator=_identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.stat_tracker = None
        if args.scale_rewards == "per_prompt":
            self.stat_tracker = PerPromptStatTracker(args.per_prompt_buffer_size, args.per_prompt_min_count)
        self._step = 0  # micro-steps taken, counts training_step calls as trl.GRPOTrainer does
        self._generation_round = 0  # rounds consumed (launched rounds may run ahead: max_staleness)
        self._in_flight: collections.deque[RoundRecord] = collections.deque()  # launched, not yet consumed
        self._next_launch = 0
        self._round_staleness = 0  # of the round being trained: rounds its sampling weights lag the trained ones
        self._workers: RemoteRollouts | None = None
        if args.rollout_server_urls:  # probed now, as remote rewards are
            self._workers = RemoteRollouts(
                self.policy, args, self.accelerator.device, self.compute_loss_context_manager
            )
            if self.accelerator.is_main_process:
                print(f"rollouts sampled by the workers {', '.join(self._workers.urls)}", flush=True)
        self._round_rows = None
        if args.max_staleness:
            self._round_rows = RoundRows(
                self.train_dataset,
                args.num_generations,
                args.generation_batch_size // args.num_generations,
                args.seed,
                self.data_parallel.rank,
                args.per_device_generation_batch_size,
            )
        use_round_progress(self.callback_handler, args.optimizer_updates_per_round)  # the bar counts rounds
        self._rollout: dict[str, Any] | None = None
        self._microbatches: list[Any] = []
        # Per process: which items are trained and the micro-batch order. Sampling noise is seeded per sample.
        self._cpu_generator = torch.Generator().manual_seed(mix_seed(args.seed, self.data_parallel.rank))
        self._reward_executor = ThreadPoolExecutor(1, "reward") if args.reward_worker_thread else None
        self._next_media_step = 0
        self._eval_policy: DiffusionPolicy | None = None  # built at the first evaluation
        self.reward_metrics = RewardMetricLog()  # the rewards' log_metric
        self.training_signal = TrainingSignal(args.max_idle_rounds)

    def _probe_rewards(
        self, policy: DiffusionPolicy, dataset: Dataset | IterableDataset, video_frames: int | None
    ) -> None:
        """Call every reward and judge (audio ones aside) once on 2 random images or videos of the run's size with
        the dataset's first rows: a reward that raises or returns the wrong values stops the run now, named."""
        rows = list(itertools.islice(iter(dataset), 2))
        funcs = [f for f in [*self.reward_funcs, *self.eval_judges] if not getattr(f, "accepts_audio", False)]
        if not rows or not funcs:
            return
        settings = policy.settings
        shape = (3, settings.height, settings.width)
        frames = (settings.num_frames or 1,) if policy.is_video else ()
        images = torch.rand(len(rows), *frames, *shape, generator=torch.Generator().manual_seed(0))
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        extra = {"trainer_state": TrainerState(), "log_metric": lambda name, value: None}  # nothing reaches the log
        try:
            score_images(funcs, [row["prompt"] for row in rows], images, columns, video_frames, [0] * len(rows),
                         extra)  # fmt: skip
        except RewardError as error:
            raise error.at("probing the rewards on random samples (probe_rewards=False skips it): ") from error.error
        except ValueError as error:
            raise ValueError(
                f"probing the rewards on random samples (probe_rewards=False skips it): {error}"
            ) from error

    def _reward_routes(self, policy: DiffusionPolicy, args: RolloutConfig) -> torch.Tensor | None:
        """(S, F) bool: which of the F rewards each of the policy's S streams trains on, from the rewards' modalities
        (:func:`~trl_dance.rewards.base.reward_modality`); None where every reward judges every stream."""
        given = args.reward_modalities
        if given is not None and len(given) != len(self.reward_funcs):
            raise ValueError(f"{len(given)} reward_modalities for {len(self.reward_funcs)} reward functions")
        modalities = [
            reward_modality(f, m) for f, m in zip(self.reward_funcs, given or [None] * len(self.reward_funcs))
        ]
        if all(modality == "both" for modality in modalities):
            return None
        streams = policy.streams
        if streams is None:
            audio = [n for n, m in zip(self.reward_names, modalities) if m == "audio"]
            if audio:
                raise ValueError(
                    f"rewards {audio} judge audio, which {type(policy.pipeline).__name__} does not generate"
                )
            return None  # a video reward on a one-stream family judges all of it
        if (why := self._routing_refusal(args)) is not None:
            raise ValueError(f"rewards routed per modality ({dict(zip(self.reward_names, modalities))}): {why}")
        refusals = {
            "rollout workers do not return per-stream log-probabilities": bool(args.rollout_server_urls),
            "scale_rewards='per_prompt' keeps one statistic per prompt, not per stream": args.scale_rewards
            == "per_prompt",
        }
        for why, refused in refusals.items():
            if refused:
                raise ValueError(f"rewards routed per modality: {why}")
        policy.runtime.stream_log_probs = True
        return torch.tensor([[m in (stream, "both") for m in modalities] for stream in streams])

    def _routing_refusal(self, args: RolloutConfig) -> str | None:
        """Why this method cannot train each stream on its own rewards' advantages (None: it can)."""
        return f"{type(self).__name__} does not route rewards; DanceGRPOTrainer and DiffusionNFTTrainer do"

    # ----------------------------------------------------------------------------------------------------------
    # What a method defines

    @property
    def _trains_on_advantages(self) -> bool:
        """Whether the loss reads the rewards' group advantages (DMD's distribution matching does not)."""
        return True

    def _check_policy(self, policy: DiffusionPolicy, args: RolloutConfig) -> None:
        """Construction checks that need the policy (the trainable steps, the model family)."""

    def rollout_plan(self, round_index: int | None = None) -> RolloutPlan:
        """The noise plan of round ``round_index`` (default: the next round)."""
        raise NotImplementedError

    def _sample_plan(self, plan: RolloutPlan, first_index: int, batch: int, round_index: int) -> RolloutPlan:
        """Round ``round_index``'s plan for this process's ``batch`` samples from global index ``first_index`` (a
        method with a window per group gives each sample its group's)."""
        return plan

    @staticmethod
    def _needs_reference(args: RolloutConfig) -> bool:
        """Whether the loss calls the reference model (the KL term)."""
        return args.beta > 0

    def _reference_model(
        self, policy: DiffusionPolicy, args: RolloutConfig, peft_config: LoraConfig | None
    ) -> torch.nn.Module | None:
        """A reference denoiser other than the trained one's base (None: the LoRA disabled, or a frozen copy)."""
        return None

    def _rollout_model(self) -> torch.nn.Module:
        """The denoiser the rounds' rollouts call (the trained one, wrapped)."""
        return self.model_wrapped

    def _keep_means(self) -> bool:
        """Whether rollouts store each stochastic step's mean."""
        return False

    def _grad_steps(self, plan: RolloutPlan, batch: int, first_index: int) -> torch.Tensor | None:
        """(B, N) bool (host): the (sample, step) denoiser calls of this process's round that the rollout runs with
        gradients, their log-probabilities kept differentiable (recompute-free GRPO); None: none."""
        return None

    def _branching(self) -> bool:
        """Whether a group's samples share the deterministic prefix of the plan (computed once per group)."""
        return False

    def _plan_round(self, rollout: dict[str, torch.Tensor], plan: RolloutPlan, advantages: torch.Tensor) -> list:
        """Keep what the loss needs of a round's rollout in ``self._rollout`` and return the round's micro-batch plans
        (``steps_per_generation · num_iterations`` of them), each turned into inputs by :meth:`_microbatch`."""
        raise NotImplementedError

    def _microbatch(self, plan) -> dict[str, Any]:
        raise NotImplementedError

    def _round_cond(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The conditioning of the current round's samples ``rows`` ((n,) long on the device): each one's prompt's
        entries of the round's table, encoded once per distinct prompt."""
        rollout = self._rollout
        return {key: value[rollout["prompt_index"][rows]] for key, value in rollout["cond"].items()}

    def _signal_items(self, advantages: torch.Tensor) -> torch.Tensor | None:
        """How many of this process's samples can carry a gradient, from its advantages (``None``: the method counts
        its items into ``training_signal`` itself, on every process)."""
        if self.args.beta:
            return None
        nonzero = advantages != 0  # routed (B, S): a sample counts if any stream's advantage is non-zero
        return (nonzero.any(dim=1) if nonzero.ndim == 2 else nonzero).sum()

    def _idle_causes(self) -> tuple[str, str]:
        """Why a round trained nothing: (no item could contribute, every update's gradient was zero), each naming
        what to change."""
        return (
            "every advantage is zero: each group's rewards are equal (frac_reward_zero_std 1). Check that the rewards "
            "vary between samples of a prompt; raise num_generations or the sampling noise",
            "the gradient was exactly zero in every optimizer update; check that the loss depends on the trained "
            "parameters",
        )

    # ----------------------------------------------------------------------------------------------------------
    # Construction checks

    @classmethod
    def _check_dataset(cls, dataset: Dataset | None, args: RolloutConfig) -> None:
        if dataset is None:
            raise ValueError(f"{cls.__name__} needs a train_dataset with a 'prompt' column")
        if not isinstance(dataset, (Dataset, IterableDataset)):
            raise TypeError(
                f"train_dataset must be a datasets.Dataset or IterableDataset, got {type(dataset).__name__}"
            )
        if "prompt" not in _columns(dataset):
            raise ValueError(f"train_dataset needs a 'prompt' column; it has {_columns(dataset)}")
        if isinstance(dataset, IterableDataset):
            if args.max_steps <= 0:
                raise ValueError("a streaming (Iterable) train_dataset has no length: set max_steps > 0")
            if args.context_parallel_size > 1:
                raise ValueError(STREAMING_WITH_CONTEXT_PARALLEL)
            return
        prompts_per_round = args.generation_batch_size // args.num_generations
        if len(dataset) < prompts_per_round:
            raise ValueError(
                f"train_dataset has {len(dataset)} prompts but each round uses {prompts_per_round} "
                f"(generation_batch_size / num_generations)"
            )

    # ----------------------------------------------------------------------------------------------------------
    # Data: one generation batch of prompt rows per round, repeated for every micro-step of the round

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def get_train_dataloader(self):
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset):
            # The sampler's order as a stream (TRL's streaming counterpart of RepeatSampler): a buffered shuffle,
            # reshuffled every epoch, each prompt num_generations times, each round's prompts for all its micro-steps.
            dataset = repeat_iterable_dataset(
                dataset.shuffle(seed=self.args.seed),
                mini_repeat_count=self.args.num_generations,
                batch_size=self.args.generation_batch_size // self.args.num_generations,
                repeat_count=self.args.num_iterations * self.args.steps_per_generation,
            )
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self.args.per_device_generation_batch_size,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_train_sampler(self, dataset: Dataset | None = None) -> Sampler:
        # Every process draws the same global order (same seed); accelerate gives process p the p-th slice of each
        # global generation batch (with context parallelism, the ranks of a group the same slice). Groups are
        # contiguous and may span processes: rewards are gathered before the advantages are computed.
        sampler = EpochSeededRepeatSampler(
            data_source=dataset if dataset is not None else self.train_dataset,
            mini_repeat_count=self.args.num_generations,
            batch_size=self.args.generation_batch_size // self.args.num_generations,
            repeat_count=self.args.num_iterations * self.args.steps_per_generation,
            shuffle=True,
            seed=self.args.seed,
            epoch=self._resume_epoch,
        )
        if self.data_parallel.group == 1:
            return sampler
        dp = self.data_parallel
        return GroupReplicatedSampler(sampler, self.args.per_device_generation_batch_size, dp.size, dp.group)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        return loss

    def _prepare_inputs(self, generation_batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        generate_every = self.args.round_micro_steps
        if self._step % generate_every == 0 or self._rollout is None:
            self._generate_and_score(generation_batch)
        return self._microbatch(self._microbatches[self._step % generate_every])

    # ----------------------------------------------------------------------------------------------------------
    # Rollout

    def _initial_noise(
        self, generators: list[torch.Generator], first_index: int, round_index: int | None = None
    ) -> torch.Tensor:
        """Starting latents of round ``round_index`` (default: the next to consume); with
        ``share_initial_noise="group"`` drawn once per group (seeded by the round and the group id)."""
        if self.args.share_initial_noise != "group":
            return self.policy.initial_noise(generators)
        seed, size = self.args.seed, self.args.num_generations
        round_index = self._generation_round if round_index is None else round_index
        return self.policy.initial_noise(group_generators(seed, round_index, first_index, len(generators), size))

    @torch.no_grad()
    def sample(
        self,
        prompts: list[str],
        generators: list[torch.Generator],
        model: torch.nn.Module | None = None,
        cond: dict[str, torch.Tensor] | None = None,
        initial_noise: torch.Tensor | None = None,
        columns: dict[str, list] | None = None,
        plan: RolloutPlan | None = None,
        groups: list[int] | None = None,
        grad_steps: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Denoise one batch along a noise plan (:func:`trl_dance.sampling.generate`), under the Trainer's autocast.

        Args:
            prompts: B prompts (ignored when ``cond`` is given).
            columns: the B values of each of the policy's ``condition_columns`` (image-to-video: ``image``), used
                with ``prompts`` when ``cond`` is not given.
            generators: B CPU generators; sample ``b`` draws its initial noise (unless ``initial_noise`` is given) and
                then the noise of all N steps from ``generators[b]``, so it depends neither on the batch it is in nor
                on which steps the plan makes stochastic.
            model: the denoiser to call (default: the Trainer's wrapped model).
            cond: precomputed conditioning of the B samples.
            initial_noise: (B, ...) starting latents to use instead of drawing them.
            plan: the noise plan (default: :meth:`rollout_plan` of the next round).
            groups: B group ids of samples sharing initial noise and prompt, to branch from a shared prefix.
            grad_steps: (B, N) bool, the denoiser calls made with gradients (see :func:`trl_dance.sampling.rollout`).

        Returns:
            ``latents`` (B, S + 1, ...) float32, the states around the S stored (stochastic, trainable) steps;
            ``log_probs`` (B, S); ``means`` (B, S, ...) if :meth:`_keep_means`; ``final_latents`` (B, ...);
            ``images`` (B, 3, H, W) float32 in [0, 1] (videos: (B, F, 3, H, W)) decoded from them;
            ``denoiser_calls``, the (sample, step) evaluations made.
        """
        model = self.model_wrapped if model is None else model
        plan = self.rollout_plan() if plan is None else plan
        if cond is None:
            cond = self.policy.encode_prompts(prompts, **(columns or {}))
        with self.compute_loss_context_manager():
            return generate(
                self.policy,
                model,
                generators,
                cond,
                plan,
                initial_noise,
                groups,
                keep_means=self._keep_means(),
                decode_audio=self._decode_audio,
                grad_steps=grad_steps,
            )

    def generate_images(self, prompts: list[str], seed: int = 0, **columns: list) -> torch.Tensor:
        """One image per prompt from the current policy with the training sampler, reproducible for ``seed``;
        ``columns`` gives one value per prompt of each of the policy's ``condition_columns`` (``image=[...]``).

        Call it on every process (under DeepSpeed ZeRO-3 the forward is collective). Returns (B, 3, H, W) in [0, 1]
        (videos: (B, F, 3, H, W)).
        """
        generators = [torch.Generator().manual_seed(mix_seed(seed, i)) for i in range(len(prompts))]
        return self.sample(prompts, generators, model=self.model, columns=columns)["images"]

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.training_signal.add_grad_norm(grad_norm)
        return grad_norm

    def _generate_and_score(self, rows: list[dict[str, Any]]) -> None:
        with self.performance.phase("rollout"), named_out_of_memory("rollout", self.args):
            self._generate_and_score_round(rows)
        # A context-parallel group's ranks train the same samples: each counts its share.
        self.performance.add_samples(len(rows) / self.args.context_parallel_size)

    def _generate_and_score_round(self, rows: list[dict[str, Any]]) -> None:
        """Start round k (``rows``: the data loader's): launch what is due (round k; with ``max_staleness = s``, every
        round up to k + s not yet launched, by the current weights), then consume round k."""
        args = self.args
        reduce = functools.partial(self.accelerator.reduce, reduction="sum")
        if self._generation_round > 0 and self.training_signal.end_round(
            self._generation_round - 1, *self._idle_causes(), reduce
        ):
            self._metrics["idle_rounds"].append(torch.tensor(float(self.training_signal.idle_rounds)))
        k = self._generation_round
        if not args.max_staleness:
            return self._consume_round(self._launch_round(k, rows), rows)
        self._next_launch = max(self._next_launch, k)  # a fresh run, or a resume without rounds in flight
        last = min(k + args.max_staleness, rounds_in_run(self.state.max_steps, args.optimizer_updates_per_round) - 1)
        while self._next_launch <= max(last, k):
            j = self._next_launch
            self._in_flight.append(self._launch_round(j, rows if j == k else self._round_rows(j)))
            self._next_launch += 1
        self._consume_round(self._in_flight.popleft(), rows)

    def _round_inputs(self, rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, list], list, torch.Tensor]:
        """A round's prompts, its other columns, each row's identity (prompt and conditioning content) and each row's
        index (B,) among the distinct identities, in order of first appearance."""
        prompts = [row["prompt"] for row in rows]
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        keys = self._row_keys(rows)
        unique = list(dict.fromkeys(keys))
        prompt_index = torch.tensor([unique.index(key) for key in keys], device=self.accelerator.device)
        return prompts, columns, keys, prompt_index

    def _row_keys(self, rows: list[dict[str, Any]]) -> list[tuple]:
        """Each row's identity: its prompt and the content of its conditioning columns."""
        return [(row["prompt"], *(_fingerprint(row[name]) for name in self.policy.condition_columns)) for row in rows]

    def _round_plan(self, round_index: int, first_index: int, batch: int) -> RolloutPlan:
        return self._sample_plan(self.rollout_plan(round_index), first_index, batch, round_index)

    def _launch_round(self, round_index: int, rows: list[dict[str, Any]]) -> RoundRecord:
        """Roll out round ``round_index`` of this process's ``rows`` with the current weights (main thread) and submit
        each chunk's rewards (to the reward worker, or scored here without one)."""
        args = self.args
        prompts, columns, keys, prompt_index = self._round_inputs(rows)
        batch = len(prompts)

        # Encode each distinct prompt (with its conditioning image, if any) once, not once per generation.
        conditions = self.policy.condition_columns
        firsts = [rows[keys.index(key)] for key in dict.fromkeys(keys)]
        cond_table = self.policy.encode_prompts(
            [row["prompt"] for row in firsts], **{name: [row[name] for row in firsts] for name in conditions}
        )

        first_index = self.data_parallel.rank * batch  # of this process's samples in the global batch
        generators = sample_generators(args.seed, round_index, first_index, batch)
        plan = self._round_plan(round_index, first_index, batch)
        groups = None
        if self._branching() or plan.group_noise_steps:  # host integers: no device read picks a group's samples
            groups = [(first_index + j) // args.num_generations for j in range(batch)]
        grad_steps = self._grad_steps(plan, batch, first_index)
        chunk = args.rollout_batch_size or batch
        record = RoundRecord(round_index, self._generation_round, rows, plan, cond_table, {}, [], 0)
        if self._workers is not None:
            self._workers.publish(record.version, self._rollout_weights())
        parts, differentiable = [], []
        # One move each way of an offloaded frozen expert per round, not per chunk.
        with self.policy.sampling():
            for chunk_start in range(0, batch, chunk):
                part = slice(chunk_start, chunk_start + chunk)
                idx = prompt_index[part]
                cond = {key: value[idx] for key, value in cond_table.items()}
                initial_noise = self._initial_noise(generators[part], first_index + chunk_start, round_index)
                scorer = functools.partial(
                    self._score_chunk, prompts[part], {key: values[part] for key, values in columns.items()},
                    first_index + chunk_start, round_index,
                )  # fmt: skip
                if self._workers is not None:  # sampled and scored off the main thread; verified when consumed
                    request = {
                        "version": record.version, "round": round_index, "first_index": first_index + chunk_start,
                        "chunk_start": chunk_start, "plan": plan.part(part).to_dict(),
                        "groups": None if groups is None else groups[part], "keep_means": self._keep_means(),
                        "decode_audio": self._decode_audio,
                    }  # fmt: skip
                    score = functools.partial(self._score_in_reward_worker, scorer, record)
                    record.chunks.append(self._workers.submit(request, cond, initial_noise, generators[part], score))
                    continue
                parts.append(
                    self.sample(
                        prompts[part],
                        generators[part],
                        model=self._rollout_model(),
                        cond=cond,
                        initial_noise=initial_noise,
                        plan=plan.part(part),
                        groups=None if groups is None else groups[part],
                        grad_steps=None if grad_steps is None else grad_steps[part],
                    )
                )
                for rows_, i, log_prob in parts[-1].pop("grad_log_probs", []):  # rows of the round's batch
                    differentiable.append((rows_ + chunk_start, i, log_prob))
                # Score this chunk (in the worker thread, while the next chunk or round is denoised).
                score = functools.partial(scorer, parts[-1])
                if self._reward_executor:
                    record.scores.append(self._reward_executor.submit(_timed, score, record.reward_seconds))
                else:
                    with self.performance.phase("reward"), named_out_of_memory("reward", args):
                        record.scores.append(score())
        if parts:
            record.calls = sum(part.pop("denoiser_calls") for part in parts)
            record.rollout = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        if grad_steps is not None:
            record.rollout["grad_log_probs"] = differentiable
        return record

    def _score_chunk(
        self,
        prompts: list[str],
        columns: dict[str, list],
        first_index: int,
        round_index: int,
        samples: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """(n, F) rewards of a chunk's ``samples`` (its first sample at global index ``first_index``) of round
        ``round_index``; zeros on the ranks of a context-parallel group but its first, which scores the same samples."""
        if not self.data_parallel.is_group_leader:
            return torch.zeros(len(prompts), len(self.reward_funcs), device=self.accelerator.device)
        groups = [(first_index + i) // self.args.num_generations for i in range(len(prompts))]
        try:
            return score_images(
                self.reward_funcs,
                prompts,
                samples["images"],
                columns,
                self.args.video_reward_frames,
                groups,
                self._reward_extra(),
                self._audio(samples),
            )
        except RewardError as error:
            raise error.at(f"round {round_index}, samples from {first_index}: ") from error.error

    def _score_in_reward_worker(self, scorer, record: RoundRecord, rollout: dict) -> torch.Tensor:
        """A worker's verified chunk scored by the reward worker (from a client thread), timed into the round's."""
        return self._reward_executor.submit(_timed, functools.partial(scorer, rollout), record.reward_seconds).result()

    def _rollout_weights(self) -> dict[str, torch.Tensor]:
        """The trained tensors rollouts sample with (the LoRA), by the denoiser's parameter names."""
        return trainable_tensors(self.policy.denoiser)

    def _consume_round(self, record: RoundRecord, rows: list[dict[str, Any]]) -> None:
        """Await round ``record``'s rewards, gather them, turn them into advantages and plan its micro-batches
        (``rows``: the data loader's rows of the round, which the launched ones must equal)."""
        args = self.args
        prompts, _, keys, prompt_index = self._round_inputs(record.rows)
        if record.rows is not rows and keys != self._row_keys(rows):
            raise RuntimeError(
                f"round {record.round} was launched ahead with other prompts than the data loader gives it "
                f"({prompts[:2]} vs {[row['prompt'] for row in rows[:2]]}): the sampler's order could not be "
                "predicted; run with max_staleness=0"
            )
        batch, plan = len(prompts), record.plan
        first_index = self.data_parallel.rank * batch
        # What the rollout left of the reward worker's time (a reward's error surfaces here).
        waited = time.perf_counter()
        with self.performance.phase("reward"), named_out_of_memory("reward", args):
            rewards = record.wait()
        rollout = record.rollout
        if self._workers is not None:
            self._workers.audit(record, prompt_index, first_index)
        if args.max_staleness:
            self._log_async_metrics(record, time.perf_counter() - waited)
        self._round_staleness = record.staleness
        all_rewards = self.data_parallel.gather(rewards)  # (num_processes · B, F), in global sample order
        for name, value in self.reward_metrics.flush(self.accelerator).items():
            self._metrics[name].append(torch.tensor(value))
        if all_rewards.isnan().all(dim=1).any():  # every process sees it: name the prompt (a collective, so here)
            weighted_reward_sum(all_rewards, self.reward_weights, self.data_parallel.gather_object(prompts))
        total = weighted_reward_sum(all_rewards, self.reward_weights)
        all_advantages = self._routed_advantages(all_rewards, total, prompts)
        local = slice(first_index, first_index + batch)
        advantages = all_advantages[local]
        if (items := self._signal_items(advantages)) is not None:
            self.training_signal.add_items(items)
        self._log_rollout_metrics(all_rewards, total, all_advantages, plan, record.calls / batch)
        self._log_rollout_media(rollout["images"], prompts, total[local], total)

        self._rollout = {
            "advantages": advantages,
            "prompt_index": prompt_index,
            "cond": record.cond,
            "prompts": prompts,
            # Kept for inspection, off the accelerator: a round of 33-frame 480p videos is 1.3 GB in float32.
            "images": rollout["images"].cpu(),
            "rewards": total[local],
        }
        self._microbatches = self._plan_round(rollout, plan, advantages)
        if len(self._microbatches) != args.round_micro_steps:  # (a method's plan must fill the round it declared)
            raise RuntimeError(
                f"{type(self).__name__} planned {len(self._microbatches)} micro-batches for a round of "
                f"{args.round_micro_steps} (steps_per_generation × num_iterations)"
            )
        self._generation_round += 1

    def _log_async_metrics(self, record: RoundRecord, waited: float) -> None:
        """Staleness and reward time of a consumed round (host numbers, this process's): ``async/reward_s`` the
        round's scoring time, ``async/reward_exposed_s`` the part the trainer waited for."""
        self._metrics["async/staleness"].append(torch.tensor(float(record.staleness)))
        self._metrics["async/reward_s"].append(torch.tensor(sum(record.reward_seconds)))
        self._metrics["async/reward_exposed_s"].append(torch.tensor(waited))

    def _audio(self, samples: dict) -> tuple[torch.Tensor, int] | None:
        """The soundtracks of generated ``samples`` and their sample rate, for rewards that score audio (LTX-2)."""
        return (samples["audio"], self.policy.audio_sample_rate) if "audio" in samples else None

    def _routed_advantages(self, all_rewards: torch.Tensor, total: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """:meth:`_advantages` (num_processes · B,); with rewards routed per modality (num_processes · B, S): stream
        s's from the rewards routed to it alone, as if they were the only ones (0 where none is)."""
        if self.reward_routes is None:
            return self._advantages(all_rewards, total, prompts)
        columns = []
        for routed in self.reward_routes:
            rewards, weights = all_rewards[:, routed], self.reward_weights[routed]
            if not routed.any():
                columns.append(torch.zeros_like(total))
            else:
                columns.append(self._advantages(rewards, weighted_reward_sum(rewards, weights), prompts, weights))
        return torch.stack(columns, dim=1)

    def _advantages(
        self, all_rewards: torch.Tensor, total: torch.Tensor, prompts: list[str], weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(num_processes · B,) advantages of the gathered rewards (F columns, ``weights``: default the trainer's)
        and their weighted sum."""
        args = self.args
        if args.multi_objective_aggregation != "sum_then_normalize":
            renormalize = args.multi_objective_aggregation == "normalize_then_sum"
            epsilon = (1e-4 if renormalize else 1e-8) if args.advantage_epsilon is None else args.advantage_epsilon
            weights = self.reward_weights if weights is None else weights
            return normalized_reward_sum(
                all_rewards, weights, args.num_generations, args.adv_clip_max, epsilon, renormalize
            )
        if self.stat_tracker is not None:
            # Every process updates an identical tracker with the same global (prompt, reward) list.
            return self.stat_tracker(self.data_parallel.gather_object(prompts), total, clip=args.adv_clip_max)
        return group_advantages(
            total, args.num_generations, args.scale_rewards, args.advantage_epsilon, args.adv_clip_max
        )

    # ----------------------------------------------------------------------------------------------------------
    # Evaluation: the deterministic sampler on held-out prompts, fixed noise, every reward

    def evaluate(
        self, eval_dataset: Dataset | None = None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Score ``eval_dataset`` (default: the trainer's): ``eval_num_generations`` samples per prompt with the
        deterministic sampler (no SDE noise; ``eval_num_inference_steps``, ``eval_guidance_scale``,
        ``eval_negative_prompt`` where set) from noise seeded by (``eval_seed``, sample index), so that evaluations at
        different steps compare policies on the same starts; with ``use_ema``, the EMA weights. Logs and returns
        ``{prefix}_reward``, ``{prefix}_reward_std`` and ``{prefix}_rewards/<name>/mean|std``; sends the first
        ``num_completions_to_log`` images to the trackers and writes ``{prefix}_samples_step<N>.png`` to
        ``output_dir``. Call on every process."""
        dataset = text_prompts(eval_dataset) if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate needs an eval_dataset (given here or to the trainer)")
        args = self.args
        # Rounds launched ahead finish scoring first: the rewards have one caller at a time.
        for record in self._in_flight:
            record.wait()
        if self._eval_policy is None:
            self._eval_policy = evaluation_policy(self.policy, args)
        rows = [row | {_GROUP: i} for i, row in enumerate(dataset) for _ in range(args.eval_num_generations)]
        scores, first = [], None
        for chunk, samples in self._eval_samples(self._eval_policy, rows):
            images = samples["images"]
            prompts = [row["prompt"] for row in chunk]
            columns = {key: [row[key] for row in chunk] for key in chunk[0] if key not in ("prompt", _GROUP)}
            groups = [row[_GROUP] for row in chunk]  # a chunk may hold part of a group: scored as a smaller one
            extra = self._reward_extra()
            scores.append(
                score_images(
                    self.reward_funcs,
                    prompts,
                    images,
                    columns,
                    args.video_reward_frames,
                    groups,
                    extra,
                    self._audio(samples),
                )
            )
            if self.eval_judges:  # held-out judges: scored here only, never trained on
                scores[-1] = torch.cat([scores[-1], score_images(self.eval_judges, prompts, images, columns,
                    args.video_reward_frames, groups, extra, self._audio(samples))], dim=1)  # fmt: skip
            first = (images.cpu(), prompts) if first is None else first
        all_scores = self.data_parallel.gather(torch.cat(scores))[: len(rows)]  # (n, F + judges), padding dropped
        judged, all_scores = all_scores[:, len(self.reward_funcs) :], all_scores[:, : len(self.reward_funcs)]
        total = weighted_reward_sum(all_scores, self.reward_weights, [row["prompt"] for row in rows])
        metrics = {
            f"{metric_key_prefix}_reward": total.mean().item(),
            f"{metric_key_prefix}_reward_std": total.std().item(),
        }
        for column, name in enumerate(self.reward_names):
            metrics[f"{metric_key_prefix}_rewards/{name}/mean"] = all_scores[:, column].nanmean().item()
            metrics[f"{metric_key_prefix}_rewards/{name}/std"] = nan_std(all_scores[:, column]).item()
        for column, judge in enumerate(self.eval_judges):
            metrics[f"{metric_key_prefix}_judges/{reward_name(judge)}/mean"] = judged[:, column].nanmean().item()
        metrics |= {f"{metric_key_prefix}_{k}": v for k, v in self.reward_metrics.flush(self.accelerator).items()}
        self.log(metrics)  # first: a tracker's writer may open at its first log
        if first is not None:
            self._log_eval_images(*first, total, metric_key_prefix)
        self.control = self.callback_handler.on_evaluate(args, self.state, self.control, metrics)
        return metrics

    # ----------------------------------------------------------------------------------------------------------
    # Metrics

    def _reward_extra(self) -> dict[str, Any]:
        """TRL's extra reward arguments: ``trainer_state`` and ``log_metric(name, value)``."""
        return {"trainer_state": self.state, "log_metric": self.reward_metrics}

    def _log_rollout_media(self, images, prompts, rewards, all_rewards) -> None:
        every, step = self.args.log_completions_steps, self.state.global_step
        if not every or step < self._next_media_step or not self.accelerator.is_main_process:
            return
        count = self.args.num_completions_to_log
        log_rollout_media(
            self.callback_handler.callbacks, step, images[:count], prompts[:count], rewards[:count], all_rewards
        )
        self._next_media_step = step - step % every + every

    def _log_rollout_metrics(
        self,
        all_rewards: torch.Tensor,
        total: torch.Tensor,
        advantages: torch.Tensor,
        plan: RolloutPlan,
        calls_per_sample: float,
    ) -> None:
        # Already gathered: every process holds the same global values.
        for column, name in enumerate(self.reward_names):  # over the samples each reward scored
            self._metrics[f"rewards/{name}/mean"].append(all_rewards[:, column].nanmean())
            self._metrics[f"rewards/{name}/std"].append(nan_std(all_rewards[:, column]))
        self._metrics["reward"].append(total.mean())
        self._metrics["reward_std"].append(total.std())
        if self._trains_on_advantages:  # (elsewhere, groups and advantages mean nothing)
            if self.args.num_generations > 1:
                group_std = total.view(-1, self.args.num_generations).std(dim=1)
                self._metrics["frac_reward_zero_std"].append((group_std < 1e-8).float().mean())
            self._metrics["advantages/abs_mean"].append(advantages.abs().mean())
        # Denoiser evaluations (sample × step, CFG branches counted once) per sample of this process's rollout.
        self._metrics["rollout/denoiser_calls_per_sample"].append(torch.tensor(calls_per_sample))

    # ----------------------------------------------------------------------------------------------------------
    # Model card

    def _sampling_record(self) -> dict[str, Any]:
        """The evaluation sampler's (training's grid and steps, the ``eval_*`` settings where given)."""
        return sampling_record(self._eval_policy or evaluation_policy(self.policy, self.args))

    def _model_card_details(self) -> dict[str, str]:
        weights = ", ".join(f"{n} × {w:g}" for n, w in zip(self.reward_names, self.reward_weights.tolist()))
        return {"rewards": weights}

    def _sample_size(self) -> str:
        """A sample's size for the model card: H×W, and the frames of a video."""
        frames = f", {self.policy.settings.num_frames} frames" if self.policy.is_video else ""
        return f"{self.args.height}×{self.args.width}{frames}"

    # ----------------------------------------------------------------------------------------------------------
    # Checkpoints: the round counter and the per-prompt statistics travel with them

    def _resume_state(self) -> dict[str, Any]:
        # The round counter (it seeds the sampling noise), the micro-step counter, the generator of timestep choice and
        # shuffling, and DDPO's per-prompt statistics; inside a round (several optimizer updates a round), the round
        # being trained: its rollout and micro-batch plan, which the weights that sampled it can no longer regenerate;
        # with max_staleness, the rounds in flight (their rewards awaited first). Resuming from any update is exact.
        state = {"generation_round": self._generation_round, "step": self._step}
        state["cpu_generator"] = self._cpu_generator.get_state()
        if self.stat_tracker is not None:
            state["stat_tracker"] = self.stat_tracker.state_dict()
        if self.args.max_staleness:
            state["max_staleness"] = self.args.max_staleness
            first_index = self.data_parallel.rank * self.args.per_device_generation_batch_size
            for record in self._in_flight:  # verified while its version's weights are here
                record.wait()
                if self._workers is not None:
                    self._workers.audit(record, self._round_inputs(record.rows)[3], first_index)
            state["in_flight"] = [record.state_dict() for record in self._in_flight]
        if self._rollout is not None and self._step % self.args.round_micro_steps:
            state["round_state"] = self._round_state()
        return state

    def _restore_resume_state(self, state: dict[str, Any]) -> None:
        saved = state.get("max_staleness", 0)
        if saved and saved != self.args.max_staleness:
            raise ValueError(
                f"the checkpoint was saved at max_staleness={saved} with rounds in flight sampled by older weights; "
                f"resume it with max_staleness={saved}, not {self.args.max_staleness}"
            )
        self._generation_round, self._step = state["generation_round"], state["step"]
        self._cpu_generator.set_state(state["cpu_generator"])
        if self.stat_tracker is not None:
            self.stat_tracker.load_state_dict(state["stat_tracker"])
        self._rollout = None
        batch = self.args.per_device_generation_batch_size
        first_index = self.data_parallel.rank * batch
        self._in_flight = collections.deque(
            RoundRecord.from_state(
                record, self._round_rows(record["round"]), self._round_plan(record["round"], first_index, batch)
            )
            for record in state.get("in_flight", [])
        )
        self._next_launch = self._generation_round + len(self._in_flight)
        if "round_state" in state:
            self._restore_round_state(state["round_state"])

    def _update_boundary_state(self) -> dict[str, Any]:
        generator = self._cpu_generator.get_state()
        return {"generation_round": self._generation_round, "step": self._step, "cpu_generator": generator}

    def _restore_update_boundary_state(self, state: dict[str, Any]) -> None:
        self._generation_round, self._step = state["generation_round"], state["step"]
        self._cpu_generator.set_state(state["cpu_generator"])

    def _round_state(self) -> dict[str, Any]:
        """What training the rest of the current round needs (a checkpoint inside a round)."""
        return {"rollout": self._rollout, "microbatches": self._microbatches, "staleness": self._round_staleness}

    def _restore_round_state(self, state: dict[str, Any]) -> None:
        self._rollout, self._microbatches = state["rollout"], state["microbatches"]
        self._round_staleness = state["staleness"]


__all__ = ["RolloutTrainer"]
