"""What a diffusers denoiser needs from TRL's trainer base, shared by every trainer of this package.

The Trainer sees only the trainable denoiser (transformer or UNet, possibly with a LoRA adapter); the rest of the
pipeline lives in a :class:`~trl_dance.policies.DiffusionPolicy`. The overrides here are the integration points a
diffusers model hits inside ``transformers.Trainer``/``trl``'s ``_BaseTrainer``: telemetry, gradient
checkpointing's name, DDP defaults, diffusers-format saving and resuming, and metric logging.
"""

import contextlib
import copy
import functools
import json
import logging
import math
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import diffusers
import torch
from diffusers import DiffusionPipeline, ModularPipeline
from diffusers.training_utils import cast_training_params
from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
from huggingface_hub import save_torch_state_dict
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import TrainerState, set_seed
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .._compat import RepeatSampler, _BaseTrainer
from ..flops import DenoiserFlops
from ..lora import LORA_WEIGHTS_NAME, add_lora, has_lora, load_lora, lora_loading_code, save_lora
from ..policies import DiffusionPolicy
from ..sampling import RolloutPlan, generate, sample_generators
from ..tiny_folders import MODULAR_INDEX, is_tiny_folder, load_modular_pipeline, load_tiny_pipeline
from .checkpoints import (
    checkpoint_problem,
    named_save_failure,
    raise_if_any_failed,
    resolve_checkpoint,
    write_manifest,
)
from .context_parallel import (
    DataParallel,
    check_context_parallel,
    enable_context_parallel,
)
from .ema import EMAUpdate, EMAWeights
from .evaluation import SAMPLING_FILE, sampling_call_code
from .gradient_surgery import install_audio_to_video_surgery
from .hang_report import HangReport
from .media import log_rollout_media, use_diffusers_callbacks
from .memory_advice import named_out_of_memory
from .performance import PerformanceLog, mixed_precision_dtype
from .preemption import PreemptionHandler, UpdateBoundary, any_process
from .speed import apply_speed_options, resolve_torch_compile

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _without_zero3_init(args):
    # accelerate registers its DeepSpeed config with transformers whatever `zero3_init_flag` says, and
    # transformers' from_pretrained then builds every model under zero.Init; unregister it while loading.
    dschf = getattr(getattr(args, "deepspeed_plugin", None), "dschf", None)
    if dschf is None:
        yield
        return
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(dschf)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied when it views part of a larger storage (FSDP2's gathered parameters can be views of the
    all-gather buffer, which safetensors refuses to write)."""
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def load_pipeline(model: str | DiffusionPipeline, args, pipeline_class: str | None = None) -> DiffusionPipeline:
    """A pipeline instance from a Hub id or local folder (``from_pretrained`` of ``pipeline_class``, a diffusers
    pipeline class name, default the folder's own, with ``args.model_init_kwargs``), or as given; then every LoRA of
    ``args.merge_lora`` fused into its weights.

    Under DeepSpeed ZeRO-3 the text encoders load whole on every process (transformers would otherwise partition
    them with ``zero.Init``): they stay frozen outside the engine, which alone gathers its shards in forward.
    """
    if isinstance(model, (DiffusionPipeline, ModularPipeline)):
        return _with_merged_loras(model, args)
    if not isinstance(model, str):
        raise TypeError(f"model must be a Hub id, a local path or a diffusers pipeline, got {type(model).__name__}")
    kwargs = _init_kwargs(args)
    loader = DiffusionPipeline
    if pipeline_class is not None:
        loader = getattr(diffusers, pipeline_class, None)
        if not (isinstance(loader, type) and issubclass(loader, (DiffusionPipeline, ModularPipeline))):
            raise ValueError(f"pipeline_class must name a diffusers pipeline class, got {pipeline_class!r}")
    # A modular-only model (MiniMax-H3) has a modular_model_index.json and no model_index.json: named by its
    # pipeline class for a Hub id, recognised in a folder.
    modular = issubclass(loader, ModularPipeline) or os.path.isfile(os.path.join(model, MODULAR_INDEX))
    try:
        with _without_zero3_init(args):
            if pipeline_class is None and is_tiny_folder(model):  # (a Qwen-VL processor is rebuilt from its parts)
                pipeline = load_tiny_pipeline(model, **kwargs)
            elif modular:
                pipeline = load_modular_pipeline(model, **kwargs)
            else:
                pipeline = loader.from_pretrained(model, **kwargs)
    except OSError as err:  # huggingface_hub's "not found / offline" errors; a local folder's own errors pass
        if os.path.isdir(model):
            raise
        raise OSError(
            f"cannot load the pipeline {model!r}: there is no such folder ({os.path.abspath(model)}), and as a Hub id "
            f"it could not be loaded: {err}"
        ) from err
    pipeline.set_progress_bar_config(disable=True)
    return _with_merged_loras(pipeline, args)


def _init_kwargs(args) -> dict[str, Any]:
    """``args.model_init_kwargs`` for ``from_pretrained``: ``torch_dtype`` renamed ``dtype``, a dtype name resolved."""
    kwargs = dict(args.model_init_kwargs or {})
    if "torch_dtype" in kwargs:  # the former name, which diffusers and transformers now warn about
        kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
    dtype = kwargs.get("dtype")
    if isinstance(dtype, str) and dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    return kwargs


def denoiser_like(model, policy, what: str) -> torch.nn.Module:
    """The denoiser of ``model`` (a pipeline, or a denoiser) if it is of the policy's denoiser class, else a ValueError
    naming ``what`` (the argument it came from)."""
    if isinstance(model, (DiffusionPipeline, ModularPipeline)):
        model = getattr(model, policy.denoiser_name, None)
    if type(model) is not type(policy.denoiser):
        raise ValueError(
            f"{what} must be a {type(policy.denoiser).__name__} (or a pipeline holding one as "
            f"{policy.denoiser_name!r}) like the trained model's; got {type(model).__name__}"
        )
    return model


def load_denoiser(model, policy, args, what: str) -> torch.nn.Module:
    """A second denoiser of the policy's class (a teacher): as given (a denoiser or a pipeline), or from a Hub id or
    pipeline folder, of which only the denoiser's subfolder loads (``args.model_init_kwargs``; ``merge_lora`` is the
    trained model's and is not applied)."""
    if isinstance(model, str):
        cls, subfolder = type(policy.denoiser), policy.denoiser_name
        try:
            found = cls.load_config(model, subfolder=subfolder).get("_class_name")
            if found != cls.__name__:
                raise ValueError(
                    f"{what} must be a {cls.__name__} like the trained model's; {model!r} holds a {found} as {subfolder!r}"
                )
            model = cls.from_pretrained(model, subfolder=subfolder, **_init_kwargs(args))
        except OSError as err:
            raise OSError(f"{what}: cannot load the {subfolder!r} of {model!r}: {err}") from err
    return denoiser_like(model, policy, what)


def _with_merged_loras(pipeline: DiffusionPipeline, args) -> DiffusionPipeline:
    for index, folder in enumerate(getattr(args, "merge_lora", None) or []):
        merge_lora(pipeline, folder, f"merged_{index}")
    return pipeline


def merge_lora(pipeline: DiffusionPipeline, folder: str, name: str) -> None:
    """Fuse the diffusers-format LoRA in ``folder`` into ``pipeline``'s weights (diffusers' ``load_lora_weights``,
    ``fuse_lora``, ``unload_lora_weights``): the pipeline then samples as with the LoRA loaded, with no adapter left."""
    if not callable(getattr(pipeline, "load_lora_weights", None)):
        raise ValueError(f"merge_lora: {type(pipeline).__name__} does not load LoRA weights")
    if not os.path.isfile(os.path.join(folder, LORA_WEIGHTS_NAME)):
        raise FileNotFoundError(f"merge_lora: no {LORA_WEIGHTS_NAME} in {folder!r}")
    pipeline.load_lora_weights(folder, weight_name=LORA_WEIGHTS_NAME, adapter_name=name)
    pipeline.fuse_lora(adapter_names=[name])
    pipeline.unload_lora_weights()


MAX_SHARD_SIZE = "10GB"  # diffusers' save_pretrained default
_PROCESS_STATE = "trl_dance_state_{}.pt"
_SHARD_PATTERN = SAFETENSORS_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors")


def tracking_links() -> dict[str, str]:
    """The current run's pages on the trackers TRL's model cards link (W&B run, Trackio space, Comet experiment),
    by tracker name; only those with a run in this process (TRL's helpers)."""
    from transformers import is_wandb_available
    from trl.trainer.utils import get_comet_experiment_url, get_trackio_space_url

    wandb_url = None
    if is_wandb_available():
        import wandb

        wandb_url = wandb.run.url if wandb.run is not None else None
    links = {"W&B run": wandb_url, "Trackio": get_trackio_space_url(), "Comet experiment": get_comet_experiment_url()}
    return {name: url for name, url in links.items() if url}


def base_model_license(base_model: str | None) -> dict[str, str]:
    """``license`` (and ``license_name``, ``license_link``) of the base model's card: from the local folder's
    README.md, the Hub cache, or the Hub when online; empty if none is found (never fails)."""
    from huggingface_hub import ModelCard, try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_OFFLINE

    if not base_model:
        return {}
    if os.path.isdir(base_model):
        path = os.path.join(base_model, "README.md")
        if not os.path.isfile(path):
            return {}
    else:
        cached = try_to_load_from_cache(base_model, "README.md")
        path = cached if isinstance(cached, str) else None if HF_HUB_OFFLINE else base_model
        if path is None:
            return {}
    try:
        data = ModelCard.load(path).data.to_dict()
    except Exception:  # no card, no network, malformed metadata: the card is written without a licence
        return {}
    return {key: data[key] for key in ("license", "license_name", "license_link") if data.get(key)}


class EpochSeededRepeatSampler(RepeatSampler):
    """TRL's ``RepeatSampler`` with epoch ``e``'s order drawn from ``seed + e`` instead of a generator carried across
    epochs, so a resumed run (a new sampler, created at the checkpoint's epoch) draws every epoch's prompt order again
    (epoch 0's is ``RepeatSampler``'s). The epoch advances with each pass; ``set_epoch`` sets it where the Trainer
    reaches the sampler (with several processes accelerate's wrappers hide it after a resume)."""

    def __init__(self, *args, epoch: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            self.generator.manual_seed(self.seed + self.epoch)
        self.epoch += 1
        return super().__iter__()


def warn_if_threads_spin() -> None:
    """Say, once, how to stop torch's OpenMP threads spinning when torch was loaded before ``trl_dance`` without
    ``OMP_WAIT_POLICY`` (see ``trl_dance/__init__.py``): on a CPU they slow training many-fold on shared cores."""
    from .. import _threads

    if _threads.OMP_SPINS and not getattr(warn_if_threads_spin, "said", False):
        warn_if_threads_spin.said = True
        logger.warning(
            "torch was imported before trl_dance without OMP_WAIT_POLICY: its OpenMP threads spin between operations "
            "and training on a shared CPU can be many times slower (1.95x beside one other job on 2 cores, 36x reported under heavier load). Export "
            "OMP_WAIT_POLICY=PASSIVE before starting Python, or import trl_dance first (the trl-dance command does)."
        )


class DiffusionTrainer(_BaseTrainer):
    """Base of the trainers of trl-dance: a policy's denoiser trained with TRL's Trainer machinery.

    Args:
        policy: the pipeline adapter; its denoiser becomes the Trainer's ``model``.
        args: a config derived from ``_BaseConfig``.
        peft_config: a LoRA to add (then the reference model is the adapter disabled), or None (full fine-tuning).
        need_reference: keep a frozen copy of the denoiser as reference when training without LoRA.
        ref_model: a denoiser to use as the reference instead (frozen, moved to the device).
        **trainer_kwargs: ``train_dataset``, ``data_collator``, ``callbacks``, ``optimizers``.
    """

    loss_is_scaled_for_ga = False  # compute_loss returns a per-micro-batch mean; the Trainer divides by GA
    uses_likelihood_ratio = False  # a loss on log-probability ratios against the rollouts: rollouts must be exact
    _decode_audio = False  # samples carry their soundtracks (families with audio, for rewards that score it)

    def __init__(
        self,
        policy: DiffusionPolicy,
        args,
        peft_config: LoraConfig | None,
        need_reference: bool,
        ref_model: torch.nn.Module | None = None,
        **trainer_kwargs,
    ):
        self.policy = policy
        denoiser = policy.denoiser
        if args.context_parallel_size > 1:  # before any model work: the family's plan, heads and token counts
            check_context_parallel(policy, args.context_parallel_size, args.context_parallel_type)
        # The Trainer seeds in its __init__; seeding here too makes the adapter's random initialisation reproducible.
        set_seed(args.seed)
        if peft_config is not None:
            add_lora(denoiser, peft_config)
        else:
            denoiser.requires_grad_(True)
        # Trainable parameters (the LoRA, or the whole denoiser) in float32 whatever dtype the pipeline loaded in, as
        # DanceGRPO and Flow-GRPO train: in bf16 an Adam update at lr 1e-5 rounds away for most entries (measured: one
        # step moved 2.3 % of a LoRA matrix). The frozen base keeps its dtype; bf16/fp16 autocast the forward passes.
        cast_training_params(denoiser, torch.float32)
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = ref_model.requires_grad_(False).eval()
        elif need_reference and peft_config is None:
            self.ref_model = copy.deepcopy(denoiser).requires_grad_(False).eval()
        if args.activation_checkpointing:
            # transformers' Trainer enables checkpointing by this name; diffusers models call it differently.
            denoiser.activation_checkpointing_enable = lambda **_: denoiser.enable_gradient_checkpointing()
        if args.use_cpu or not torch.cuda.is_available():
            # Otherwise DeepSpeed, when installed, warns at import on every CPU run that it found no accelerator.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            warn_if_threads_spin()
        if args.ddp_find_unused_parameters is None:
            args.ddp_find_unused_parameters = False  # every trainable parameter takes part in each forward

        super().__init__(model=denoiser, args=args, **trainer_kwargs)
        use_diffusers_callbacks(self.callback_handler)
        self.data_parallel = DataParallel(self.accelerator, args.context_parallel_size)
        if args.frozen_dtype is not None:
            for module in policy.frozen_modules():
                module.to(getattr(torch, args.frozen_dtype))
        policy.runtime.offload_text_encoders = args.offload_text_encoders
        policy.to(self.accelerator.device)
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device)
        if args.context_parallel_size > 1:
            copies = [m for m in (policy.frozen_expert, self.ref_model) if m is not None]
            enable_context_parallel(
                policy,
                [denoiser, *copies],
                args.context_parallel_size,
                args.context_parallel_type,
                self.accelerator.device,
            )
            # The group's gradients are summed, not averaged; the plans split text at its padded length.
            policy.runtime.gradient_scale = args.context_parallel_size
            policy.runtime.trim_text = False
        if args.audio_to_video_gradient_scales:  # (before any call: a compiled block traces its hooks at its first)
            install_audio_to_video_surgery(denoiser, args.audio_to_video_gradient_scales)
        # Every denoiser the trainer calls: the trained one, a frozen expert, a full-fine-tuning reference.
        denoisers = [m for m in (denoiser, policy.frozen_expert, self.ref_model) if m is not None]
        apply_speed_options(
            denoisers,
            args,
            self.accelerator.device,
            masks_text=policy.masks_text,
            compile_models=resolve_torch_compile(args.torch_compile, self.accelerator.device, self.parameter_sharding),
            likelihood_ratio=type(self).__name__ if self.uses_likelihood_ratio else None,
        )
        self.performance = PerformanceLog(self.accelerator.device, args.peak_tflops, mixed_precision_dtype(args))
        self.flops = None  # the FLOPs of their calls, by the phase they run in
        if policy.flop_layout is not None:
            self.flops = DenoiserFlops(policy.flop_layout, policy.flop_tokens, 1 / args.context_parallel_size)
            self.flops.phase = self.performance.current_phase
            for module in denoisers:
                self.flops.attach(module)
        self._logged_step = 0
        self._metrics: dict[str, list[torch.Tensor]] = defaultdict(list)  # 0-dim tensors, read at log time
        self._toggle_cache: tuple = (None, None)
        self._loss_finite: torch.Tensor | None = None  # all micro-step losses since the last log were finite
        self._resume_epoch = 0  # the epoch a resumed run starts in: its sampler draws that epoch's order
        # Model card: the save_samples gallery, the dataset and tags push_to_hub was given, the base model's licence
        # (read once: with the Hub reachable it is a download, and the card is written at every save).
        self._widget: list[dict] = []
        self._card_names: dict[str, Any] = {}
        self._base_license: dict[str, str] | None = None
        self.ema = None
        if args.use_ema:
            if self.parameter_sharding is not None:
                raise ValueError(
                    f"use_ema averages whole parameters, which {self.parameter_sharding} shards: use ZeRO-2 or DDP"
                )
            self.ema = EMAWeights(denoiser, args.ema_decay)
            self.add_callback(EMAUpdate(self.ema))
        self._preemption = None
        if args.save_on_preemption:
            agree = functools.partial(any_process, self.accelerator)
            self._preemption = PreemptionHandler(args.preemption_signals, agree, args.preemption_grace_s)
            self.add_callback(self._preemption)
        self._hang_report = None
        if args.hang_report_s is not None:
            process, processes = self.accelerator.process_index, self.accelerator.num_processes
            self._hang_report = HangReport(self.performance, process, processes, args.hang_report_s)
            self.add_callback(self._hang_report)
        self._update_boundary = UpdateBoundary(self._update_boundary_state) if args.save_on_crash else None
        if self._update_boundary is not None:
            self.add_callback(self._update_boundary)

    @property
    def stopped_by(self) -> str | None:
        """What stopped the last ``train`` before ``max_steps`` with a checkpoint (a preemption signal's name), or
        None when it ran to its end."""
        return self._preemption.stopped_by if self._preemption is not None else None

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        if "dynamo_plugin" in args:  # torch_compile compiles the denoiser's blocks in place (speed.py), not the model
            from accelerate.utils import TorchDynamoPlugin

            args["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return args

    @property
    def parameter_sharding(self) -> str | None:
        """The scheme that shards the trained parameters over the processes ("DeepSpeed ZeRO-3", "FSDP"), or None."""
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            return "DeepSpeed ZeRO-3"
        return "FSDP" if self.is_fsdp_enabled else None

    @staticmethod
    def _resolve_args(model, args, config_class, suffix: str):
        """``args`` checked against ``config_class``, or its defaults with an output_dir named after the model."""
        if args is None:
            name = model if isinstance(model, str) else type(model).__name__
            return config_class(output_dir=f"{name.rstrip('/').split('/')[-1]}-{suffix}")
        if not isinstance(args, config_class):
            raise TypeError(f"args must be a {config_class.__name__}, got {type(args).__name__}")
        return args

    def _model_card_details(self) -> dict[str, str]:
        """Trainer-specific lines of the model card (name: value)."""
        return {}

    def _sampling_record(self) -> dict[str, Any] | None:
        """How the trained model samples (:func:`~trl_dance.trainer.evaluation.sampling_record`), saved beside its
        weights and shown in the card; None where training fixes no sampler (the dataset trainers)."""
        return None

    def save_samples(self, prompts: list[str], images: torch.Tensor) -> None:
        """Write ``image_<i>.png`` (a frame strip for videos) in ``output_dir`` for each prompt's sample, and show them
        in the model card's ``widget`` gallery, as diffusers' training scripts do. Main process only."""
        if not self.is_world_process_zero():
            return
        from ..visualization import to_pil

        os.makedirs(self.args.output_dir, exist_ok=True)
        self._widget = []
        for i, (prompt, image) in enumerate(zip(prompts, to_pil(images))):
            image.save(os.path.join(self.args.output_dir, f"image_{i}.png"))
            self._widget.append({"text": prompt, "output": {"url": f"image_{i}.png"}})
        self.create_model_card()

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        output_dir: str | None = None,
        **_,
    ) -> None:
        """Write ``README.md`` in ``output_dir`` (default ``args.output_dir``): a diffusers model card (base model and
        its licence, TRL-style tags, how to load the LoRA or the denoiser, the run's settings, ``samples.png`` and the
        :meth:`save_samples` gallery when present). Written at every save; ``push_to_hub`` uploads it."""
        if not self.is_world_process_zero():
            return
        from huggingface_hub import ModelCard, ModelCardData

        from ..version import __version__

        folder = output_dir or self.args.output_dir
        # The dataset and tags given to push_to_hub stay on the cards of later saves.
        given = {"dataset_name": dataset_name, "tags": tags}
        self._card_names |= {key: value for key, value in given.items() if value is not None}
        dataset_name, tags = (self._card_names.get(key) for key in ("dataset_name", "tags"))
        pipeline = self.policy.pipeline
        base_model = getattr(pipeline, "name_or_path", None) or pipeline.config.get("_name_or_path")
        hub_base = base_model if base_model and not os.path.isdir(base_model) else None
        if self._base_license is None:
            self._base_license = base_model_license(base_model)
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        denoiser = self.accelerator.unwrap_model(self.model)
        lora, denoiser_class = has_lora(denoiser), type(denoiser).__name__
        task = self.policy.pipeline_tag or ("text-to-video" if self.policy.is_video else "text-to-image")
        links = tracking_links()
        # TRL's tags: a run on Hugging Face Jobs, and the Trackio space (one "trackio:<url>" tag, the current run's).
        if "Trackio" in links:
            tags = [tag for tag in tags if not tag.startswith("trackio:")] + [f"trackio:{links['Trackio']}"]
        if "JOB_ID" in os.environ:
            tags.append("hf_jobs")
        card_tags = sorted({*self._tag_names, task, *tags, "lora" if lora else "full-finetune"})
        data = ModelCardData(
            base_model=hub_base,
            library_name="diffusers",
            pipeline_tag=task,
            tags=card_tags,
            datasets=[dataset_name] if dataset_name else None,
            widget=self._widget or None,
            **self._base_license,
        )
        pipeline_class = type(pipeline).__name__
        name = model_name or self.args.hub_model_id or os.path.basename(os.path.normpath(self.args.output_dir))
        if lora:
            path = self.args.hub_model_id or self.args.output_dir
            loading = lora_loading_code(type(pipeline), self.policy.denoiser_name, self.policy.lora_name, path)
            usage = f"pipeline = {pipeline_class}.from_pretrained({base_model!r})\n{loading}"
        else:
            usage = (
                f"{self.policy.denoiser_name} = {denoiser_class}.from_pretrained({(self.args.hub_model_id or self.args.output_dir)!r})\n"
                f"pipeline = {pipeline_class}.from_pretrained({base_model!r}, {self.policy.denoiser_name}={self.policy.denoiser_name})"
            )
        if (record := self._sampling_record()) is not None:  # as it was trained and evaluated to sample
            usage += "\n\n" + sampling_call_code(record, pipeline)
        steps = str(self.state.global_step)
        if self.state.max_steps and self.state.global_step < self.state.max_steps:  # a checkpoint, or a stopped run
            steps += f" of {self.state.max_steps}: unfinished (`--resume_from_checkpoint true` continues it)"
        details = {
            "trainer": f"{self._name} (trl-dance {__version__}), arXiv:{self._paper.get('id')}",
            "base model": str(base_model),
            "optimizer steps": steps,
            "learning rate": str(self.args.learning_rate),
            **self._model_card_details(),
        }
        lines = [
            f"# {name}",
            "",
            f"A {'LoRA' if lora else 'fine-tuned ' + self.policy.denoiser_name} for `{base_model}` trained with "
            f"[trl-dance](https://github.com/trl-dance/trl-dance)'s `{type(self).__name__}`.",
            "",
            "```python",
            f"from diffusers import {pipeline_class}" + ("" if lora else f", {denoiser_class}"),
            "",
            usage,
            "```",
            "",
            "## Training",
            "",
            *[f"- {key}: {value}" for key, value in details.items()],
        ]
        if links:  # where TRL's cards link the run
            lines += ["", *[f"- {name}: [{url}]({url})" for name, url in links.items()]]
        if os.path.isfile(os.path.join(folder, "samples.png")):
            lines += ["", "![samples: before (top) and after (bottom) training](samples.png)"]
        if self._paper.get("citation"):
            lines += ["", "## Citation", "", "```bibtex", self._paper["citation"], "```"]
        card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")
        os.makedirs(folder, exist_ok=True)
        card.save(os.path.join(folder, "README.md"))

    # Evaluation samples: the deterministic sampler, fixed noise, the EMA weights when kept (see evaluation.py).

    def _eval_plan(self, policy: DiffusionPolicy) -> RolloutPlan:
        """The evaluation's noise plan: the deterministic sampler (a trainer whose model samples otherwise, DMD2's
        re-noising student, overrides it; its noise is then seeded as the starts are)."""
        return RolloutPlan.deterministic(policy.num_steps)

    def _eval_samples(
        self, policy: DiffusionPolicy, rows: list[dict[str, Any]]
    ) -> Iterator[tuple[list, dict[str, torch.Tensor]]]:
        """Yield ``(chunk, samples)`` over this process's share of ``rows`` (dicts with ``prompt`` and the policy's
        condition columns) in chunks of ``per_device_eval_batch_size``: ``policy``'s samples (:meth:`_eval_plan`) from noise
        seeded by (``eval_seed``, row index), :func:`~trl_dance.sampling.generate`'s dict (``images`` (B, 3, H, W) in
        [0, 1], and ``audio`` where :attr:`_decode_audio`: rewards that score it). Shares are padded to equal length
        (the last row repeated: under ZeRO-3 and FSDP every process must take part in every forward), so gathered results are
        the rows in order followed by the padding. Call on every process and exhaust it."""
        args = self.args
        plan = self._eval_plan(policy)
        ema = self.ema.applied() if self.ema is not None else contextlib.nullcontext()
        indices = list(range(len(rows)))
        with ema, self.data_parallel.split(indices) as mine:
            for start in range(0, len(mine), args.per_device_eval_batch_size):
                chunk = [rows[i] for i in mine[start : start + args.per_device_eval_batch_size]]
                columns = {name: [row[name] for row in chunk] for name in policy.condition_columns}
                cond = policy.encode_prompts([row["prompt"] for row in chunk], **columns)
                generators = sample_generators(args.eval_seed, -1, mine[start], len(chunk))
                with torch.no_grad(), self.compute_loss_context_manager():
                    yield chunk, generate(policy, self.model, generators, cond, plan, decode_audio=self._decode_audio)

    def _log_eval_images(
        self, images: torch.Tensor, prompts: list[str], rewards: torch.Tensor | None, prefix: str
    ) -> None:
        """Send the first ``num_completions_to_log`` evaluation images (captioned with their prompts and rewards, if
        any) to the trackers under ``eval/`` and write them to ``{prefix}_samples_step<N>.png`` in ``output_dir``.
        Main process only."""
        if not self.accelerator.is_main_process:
            return
        from ..visualization import save_image_grid

        count, step = getattr(self.args, "num_completions_to_log", 8), self.state.global_step
        shown = None if rewards is None else rewards[:count]
        log_rollout_media(
            self.callback_handler.callbacks, step, images[:count], prompts[:count], shown, rewards, prefix
        )
        path = os.path.join(self.args.output_dir, f"{prefix}_samples_step{step}.png")
        os.makedirs(self.args.output_dir, exist_ok=True)
        save_image_grid([images[:count]], path, size=128, captions=prompts[:count])

    def _send_telemetry(self):
        # TRL's telemetry reads a transformers config (model_type); a diffusers denoiser has none.
        return

    def reference_prediction(self, model, latents, cond, at, policy=None) -> torch.Tensor:
        """The reference model's prediction at ``at`` (a step or time, see :meth:`DiffusionPolicy.predict`), without
        gradients: the LoRA disabled, or the frozen copy (through ``policy``, default the trainer's)."""
        policy = self.policy if policy is None else policy
        with torch.no_grad():
            if self.ref_model is not None:
                return policy.predict(self.ref_model, latents, cond, at=at)
            unwrapped, lora_layers = self._reference_toggle(model)
            for layer in lora_layers:
                layer.enable_adapters(False)
            try:
                return policy.predict(unwrapped, latents, cond, at=at)
            finally:
                for layer in lora_layers:
                    layer.enable_adapters(True)

    def _reference_toggle(self, model) -> tuple[torch.nn.Module, list[BaseTunerLayer]]:
        """``model`` unwrapped (a compiled module stays compiled) and its LoRA layers, found once per model: diffusers'
        ``disable_adapters`` walks every module and accelerate's ``unwrap_model`` looks DeepSpeed up among the
        installed packages, on every call (2.0 ms per step on the tiny SD3, against 0.2 ms over cached layers)."""
        if self._toggle_cache[0] is not model:
            unwrapped = self.accelerator.unwrap_model(model)
            layers = [module for module in unwrapped.modules() if isinstance(module, BaseTunerLayer)]
            self._toggle_cache = (model, (unwrapped, layers))
        return self._toggle_cache[1]

    # Metrics: averaged over the micro-steps since the last log, then handed to the Trainer's log. They stay on the
    # device until then: reading one per micro-step would cost a host-device sync each time.

    def _record(self, name: str, values: torch.Tensor) -> None:
        """Append the all-process mean of ``values`` (any shape) to the metric ``name``."""
        self._metrics[name].append(self.accelerator.gather(values.detach().float().reshape(-1)).mean())

    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.performance.phase("training"), named_out_of_memory("training", self.args):
            loss = super().training_step(model, inputs, num_items_in_batch)
        # On the device, read at the next log: a NaN loss would otherwise be hidden by logging_nan_inf_filter.
        finite = torch.isfinite(loss.detach())
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if any(key.startswith("eval_") for key in logs):  # an evaluation's: the training metrics wait for theirs
            super().log(logs, start_time)
            return
        flops = self.flops.take_by_phase() if self.flops is not None else {}
        steps = self.state.global_step - self._logged_step
        if steps or any(flops.values()):  # not on the run's closing summary when nothing ran since the last log
            logs.update(self.performance.metrics(flops, steps, self.accelerator))
        self._logged_step = self.state.global_step
        names = [key for key, values in self._metrics.items() if values]
        if names:
            # Metrics come from the GPU (losses, rewards) and the host (counters, schedules): one device, one sync.
            device = self.accelerator.device
            on_device = [[value.to(device, torch.float32) for value in self._metrics[key]] for key in names]
            means = torch.stack([torch.stack(values).mean() for values in on_device]).tolist()
            logs.update(zip(names, means))
        bad = [key for key in ("grad_norm", "loss") if key in logs and not math.isfinite(logs[key])]
        if self._loss_finite is not None and not bool(self._loss_finite) and "loss" not in bad:
            bad.append("loss")
        self._loss_finite = None
        if bad:
            raise FloatingPointError(
                f"training stopped at optimizer step {self.state.global_step}: {' and '.join(bad)} became non-finite "
                f"(logged: { {key: logs.get(key) for key in ('loss', 'grad_norm')} }). Check the rewards and the "
                "learning rate; the last checkpoint holds the last finite state."
            )
        super().log(logs, start_time)
        self._metrics.clear()

    # Saving: a diffusers-format LoRA, or the full denoiser.

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        with named_save_failure(output_dir):
            self._write_weights(output_dir, state_dict)
            if self.ema is not None:  # the EMA beside the trained weights, in the same format
                with self.ema.applied():
                    self._write_weights(os.path.join(output_dir, "ema"), None)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
            if (record := self._sampling_record()) is not None:
                with open(os.path.join(output_dir, SAMPLING_FILE), "w") as handle:
                    json.dump(record, handle, indent=2)
            self.create_model_card(output_dir=output_dir)

    def _write_weights(self, output_dir: str, state_dict: dict | None) -> None:
        """The LoRA (diffusers format) or the denoiser, from ``state_dict`` when given (gathered by DeepSpeed)."""
        os.makedirs(output_dir, exist_ok=True)
        denoiser = self.accelerator.unwrap_model(self.model)
        if has_lora(denoiser):
            save_lora(type(self.policy.pipeline), self.policy.lora_name, denoiser, output_dir, state_dict)
        elif state_dict is None:
            denoiser.save_pretrained(output_dir, max_shard_size=MAX_SHARD_SIZE)
        else:
            # DeepSpeed ZeRO-3 and FSDP hand over the gathered weights: the module's own parameters are shards. Written
            # in shards with diffusers' index name, which from_pretrained reads (FLUX in fp32 is 48 GB).
            denoiser.save_config(output_dir)
            save_torch_state_dict(
                {key: _own_storage(value.detach().to("cpu").contiguous()) for key, value in state_dict.items()},
                output_dir,
                filename_pattern=_SHARD_PATTERN,
                max_shard_size=MAX_SHARD_SIZE,
                metadata={"format": "pt"},
            )

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # The Trainer copies only transformers' file names from the checkpoint to the folder it uploads: copy what
        # diffusers loads (the LoRA file, the denoiser's config, weights and shard index) and the card too.
        if self.is_world_process_zero() and self.args.hub_strategy != "end":
            for name in os.listdir(checkpoint_folder):
                if name in (LORA_WEIGHTS_NAME, "config.json", "README.md") or name.startswith(
                    "diffusion_pytorch_model"
                ):
                    shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(self.args.output_dir, name))
        super()._push_from_checkpoint(checkpoint_folder)

    # Checkpoints: the Trainer's files, each process's own state (trainers add theirs), then a manifest, written last,
    # without which a checkpoint is not resumed from (see checkpoints.py).

    def _resume_state(self) -> dict[str, Any]:
        """This process's state beyond the Trainer's that exact resume needs (tensors, numbers, lists, dicts)."""
        return {}

    def _restore_resume_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`_resume_state`'s ``state``."""

    def _update_boundary_state(self) -> dict[str, Any]:
        """The counters and generators that move inside an optimizer update, as they are between updates (small: taken
        at every end of step). A crash checkpoint puts them back (:meth:`_restore_update_boundary_state`)."""
        return {}

    def _restore_update_boundary_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`_update_boundary_state`'s ``state``."""

    def _save_after_crash(self, error: BaseException) -> None:
        """``save_on_crash``: write ``checkpoint-N`` at the last complete update N where the state is whole."""
        boundary, step = self._update_boundary, self.state.global_step
        boundary.remove()
        raised = f"training raised {type(error).__name__} at step {step} of {self.state.max_steps}"
        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if self.accelerator.num_processes > 1:
            why = f"with {self.accelerator.num_processes} processes the others cannot join the save"
        elif not boundary.hooked:  # (DeepSpeed's optimizer: no torch step hook tells an update's inside)
            why = f"{type(self.optimizer).__name__} cannot say whether the error came inside an optimizer update"
        elif boundary.inside:
            why = f"it came inside optimizer update {step + 1}, where the state is not whole"
        elif step == 0:
            why = "no optimizer update had finished"
        elif checkpoint_problem(folder) is None:
            return logger.error("%s; %s holds that update (resume with --resume_from_checkpoint true)", raised, folder)
        elif os.path.isdir(folder):
            why = f"it came while {folder} was written"  # (a full disk: the save's own error says so)
        else:
            why = None
        if why is not None:
            return logger.error("%s; no checkpoint written: %s", raised, why)
        self._restore_update_boundary_state(boundary.state)
        try:
            self._save_checkpoint(self.model, trial=None)
        except Exception as failure:  # the original error is the one that propagates
            return logger.error("%s; its checkpoint failed too: %s", raised, failure)
        logger.error("%s; %s holds the state after update %d: resume with --resume_from_checkpoint true", raised,
                     folder, step)  # fmt: skip

    def _get_train_sampler(self, dataset=None):
        # A new random order every epoch, drawn from seed + epoch so that a resumed run draws it again (see
        # EpochSeededRepeatSampler); GRPO repeats each prompt num_generations times.
        dataset = dataset if dataset is not None else self.train_dataset
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            return super()._get_train_sampler(dataset)
        return EpochSeededRepeatSampler(dataset, mini_repeat_count=1, seed=self.args.seed, epoch=self._resume_epoch)

    def _save_checkpoint(self, model, trial):
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        error = None
        try:
            with named_save_failure(folder):  # a full disk: the path, the space left, what the last checkpoint takes
                super()._save_checkpoint(model, trial)
                state = self._resume_state() | ({"ema": self.ema.state_dict()} if self.ema is not None else {})
                torch.save(state, os.path.join(folder, _PROCESS_STATE.format(self.accelerator.process_index)))
        except Exception as caught:  # every process hears of it: the others would wait at the barrier below
            error = caught
        raise_if_any_failed(self.accelerator, error, f"saving {folder}")
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            write_manifest(folder, self.state.global_step)
        self.accelerator.wait_for_everyone()

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint`` is a checkpoint folder, or True (also ``"true"`` from the
        command line) for the latest complete one in ``output_dir``. A checkpoint whose save was interrupted, or that
        lacks a file exact resume needs, is refused naming it."""
        resume = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if resume is not None:
            path = os.path.join(resume, _PROCESS_STATE.format(self.accelerator.process_index))
            if not os.path.isfile(path):
                raise ValueError(
                    f"checkpoint {resume!r} has no {os.path.basename(path)}: it was saved by fewer processes"
                )
            epoch = TrainerState.load_from_json(os.path.join(resume, TRAINER_STATE_NAME)).epoch or 0
            self._resume_epoch = int(epoch + 1e-6)  # int(1.9999999) would be 1: an epoch boundary's float epoch
            state = torch.load(path, weights_only=True)
            if self.ema is not None:
                if "ema" not in state:
                    raise ValueError(f"checkpoint {resume!r} was saved without use_ema: it holds no EMA to resume")
                self.ema.load_state_dict(state.pop("ema"))
            self._restore_resume_state(state)
        self.performance.reset(time.perf_counter())  # the first log's wall time starts here, not at construction
        self._logged_step = self.state.global_step
        try:
            return super().train(
                resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
        except BaseException as error:
            if self._hang_report is not None:  # (its watcher would otherwise outlive the run that raised)
                self._hang_report.stop()
            if self._update_boundary is not None and isinstance(error, Exception):
                self._save_after_crash(error)
            raise

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # The Trainer's loader knows transformers/PEFT files only; ours are diffusers-format.
        denoiser = self.accelerator.unwrap_model(model if model is not None else self.model)
        if has_lora(denoiser):
            load_lora(self.policy.lora_name, denoiser, resume_from_checkpoint)
        else:
            trained = type(denoiser).from_pretrained(resume_from_checkpoint, dtype=denoiser.dtype)
            denoiser.load_state_dict(trained.state_dict())
