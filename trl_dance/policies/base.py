"""The interface between RL trainers and a diffusers pipeline.

A policy is built from parts (docs/architecture.md): a *process* (:mod:`~trl_dance.policies.process`: the step grid,
the SDE step, the forward process), a *latent layout* (:mod:`~trl_dance.policies.layout`: latents to pixels and back)
and a *runtime* (:class:`~trl_dance.policies.runtime.PolicyRuntime`: what the trainer sets for its run, shared by every
copy). A family declares its process and layout and writes its text encoding, initial noise and denoiser call. A
policy owns the pipeline's frozen parts (text encoders, VAE) and knows nothing about rewards or losses; the trainable
denoiser is passed in to :meth:`DiffusionPolicy.predict` so the trainer can call it through its DDP/DeepSpeed wrapper.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from diffusers import DiffusionPipeline

from ..flops import FlopLayout, denoiser_tokens
from ..sde import SDEStepOutput
from .layout import SpatialLatents
from .placement import FrozenModules
from .process import DiffusionProcess, FlowProcess, TimestepUnits
from .prompts import TEXT_LENGTH_MULTIPLE, cat_padded, trim_padded_text, warn_long_prompts
from .runtime import PolicyRuntime, scale_gradient
from .settings import SamplerSettings

logger = logging.getLogger(__name__)

Conditioning = dict[str, torch.Tensor]
"""Prompt conditioning: tensors with the prompt (or sample) as first dimension, indexable per sample."""

At = int | float | torch.Tensor
"""Where on the process a prediction is made: a step of the sampler's grid (an ``int`` for the whole batch, or (B,)
long step indices) or a time t ∈ [0, 1] of the forward process (a ``float`` for the whole batch, or (B,) float)."""


def _at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Float32, or float64 for a float64 model (gradient checks): predictions are combined and stepped in it."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class DiffusionPolicy(FrozenModules, ABC):
    """A diffusers pipeline seen as a stochastic policy over denoising steps.

    Steps are addressed by integer index ``i ∈ [0, N)``; step ``i`` maps the latent at index ``i`` of the
    trajectory to the one at ``i + 1``.
    """

    process_class: type[DiffusionProcess] = FlowProcess
    """The family's diffusion process (:meth:`make_process` builds it)."""

    timestep_units: TimestepUnits = "train_steps"
    """Flow families: the denoiser's timestep input at noise level σ (see :class:`~trl_dance.policies.FlowProcess`)."""

    layout_class: type[SpatialLatents] = SpatialLatents
    """The family's latent layout (:mod:`trl_dance.policies.layout`)."""

    denoiser_name: str = "transformer"
    """Attribute of the pipeline holding the trainable denoiser (also the LoRA prefix in ``save_lora_weights``)."""

    supports_cfg: bool = True
    """False for guidance-distilled families (FLUX), whose ``guidance_scale`` feeds an embedding instead."""

    has_audio: bool = False
    """True for families that generate a soundtrack with the video (LTX-2): :meth:`decode_audio` returns it, at
    :attr:`audio_sample_rate` Hz."""

    audio_sample_rate: int | None = None

    default_num_frames: int | None = None
    """Video families: the frame count used when ``settings.num_frames`` is None."""

    condition_columns: tuple[str, ...] = ()
    """Dataset columns the policy conditions on besides the prompt (image-to-video, editing: ``("image",)``)."""

    batch_conditions: tuple[str, ...] = ()
    """Per-sample conditioning that a training batch of real images supplies (SDXL: ``time_ids``, each image's size and
    crop); preference collators produce them."""

    masks_text: bool = False
    """Whether the denoiser's attention masks padded text tokens (HunyuanVideo, Qwen-Image): ring attention reuses each
    rank's key mask for the other ranks' keys, so context parallelism must be Ulysses."""

    flop_layout: FlopLayout | None = None
    """The streams each module of the denoiser reads, for FLOP counting (:mod:`trl_dance.flops`); None: not counted."""

    pipeline_tag: str | None = None
    """The Hub task of the trained model (model cards): ``"text-to-image"``/``"text-to-video"`` unless set."""

    pipeline_defaults: dict = {}
    """Arguments of the pipeline's ``__call__`` the policy reproduces besides the config's own fields, with the
    pipeline's defaults (LTX-2's guidance terms): ``settings.pipeline_kwargs`` overrides them by name."""

    padded_text: dict[str, str] = {}
    """Text embeddings the family pads with a mask, by key, to their (B, L) masks' keys (Qwen-Image:
    ``{"prompt_embeds": "prompt_embeds_mask"}``). :meth:`encode_prompts` cuts the padding beyond the call's longest
    prompt (rounded up to :data:`TEXT_LENGTH_MULTIPLE` tokens), so the denoiser's text stream and attention skip it
    (Qwen-Image at 1024²: 512 padded text tokens beside 4,096 image tokens), and CFG pads its two branches to the
    longer one. Only for denoisers whose outputs on valid tokens do not depend on the padding's length (they mask it
    out of attention; text positions count from the first token); off under context parallelism
    (``runtime.trim_text``), whose plans split the padded length."""

    optional_condition_columns: tuple[str, ...] = ()
    """Dataset columns the family conditions on when a dataset has them (Qwen-Image 2.1's optional condition
    ``image``): :meth:`use_condition_columns` makes them :attr:`condition_columns`."""

    def __init__(self, pipeline: DiffusionPipeline, settings: SamplerSettings):
        settings = self.layout_class.checked_settings(pipeline, settings, self.default_num_frames)
        self.pipeline = pipeline
        self.settings = settings
        self.runtime = PolicyRuntime()  # the run's settings (the trainer's), shared with every copy
        self.layout = self.layout_class(pipeline, settings)
        self._negative: Conditioning | None = None
        self._warned_long_prompts = False
        if settings.negative_prompt is not None and not self.use_cfg:
            raise ValueError(
                f"negative_prompt feeds the unconditional branch of CFG, which {type(pipeline).__name__} with "
                f"guidance_scale {settings.guidance_scale} does not use"
            )
        unknown = sorted(set(settings.pipeline_kwargs or {}) - set(self.pipeline_defaults))
        if unknown:
            known = ", ".join(self.pipeline_defaults) or "none"
            raise ValueError(
                f"pipeline_kwargs {unknown} are not arguments {type(self).__name__} reproduces (it takes: {known})"
            )
        multiple = self.layout.size_multiple()
        for name, size in (("height", settings.height), ("width", settings.width)):
            if size % multiple:
                raise ValueError(f"{name}={size} must be a multiple of {multiple} for {type(pipeline).__name__}")
        self.process = self.make_process()

    @property
    def pipeline_options(self) -> dict:
        """:attr:`pipeline_defaults` with ``settings.pipeline_kwargs`` applied."""
        return {**self.pipeline_defaults, **(self.settings.pipeline_kwargs or {})}

    def use_condition_columns(self, columns: list[str]) -> None:
        """Condition on those of :attr:`optional_condition_columns` among a dataset's ``columns`` (the trainer calls
        this with its training set's)."""
        optional = tuple(name for name in self.optional_condition_columns if name in columns)
        if optional:
            self.condition_columns = (*self.condition_columns, *optional)

    def make_process(self) -> DiffusionProcess:
        """The family's :attr:`process_class` on the pipeline's scheduler (flow: with :meth:`_scheduler_kwargs` and
        :attr:`timestep_units`)."""
        scheduler = self.pipeline.scheduler
        if issubclass(self.process_class, FlowProcess):
            return self.process_class(scheduler, self.settings, self._scheduler_kwargs(), self.timestep_units)
        return self.process_class(scheduler, self.settings)

    def _scheduler_kwargs(self) -> dict:
        """Flow families: extra ``set_timesteps`` arguments of the pipeline's own grid (FLUX's ``mu``)."""
        return {}

    @property
    def is_video(self) -> bool:
        """True for video families: :meth:`decode` returns (B, F, 3, H, W) and ``settings.num_frames`` applies."""
        return self.layout.is_video

    @property
    def prediction_type(self) -> str:
        return self.process.prediction_type

    @property
    def lora_name(self) -> str:
        """The denoiser's name in the pipeline's LoRA files (``<lora_name>.`` key prefix)."""
        return self.denoiser_name

    @property
    def num_steps(self) -> int:
        return self.settings.num_inference_steps

    # --- conditioning ------------------------------------------------------------------------------------------

    def encode_prompts(self, prompts: list[str], **columns: list) -> Conditioning:
        """Conditioning of each prompt (computed without gradients), first dimension ``len(prompts)``: its text
        embeddings and, for policies with :attr:`condition_columns`, what they encode from those columns' values
        (one per prompt)."""
        missing = [name for name in self.condition_columns if name not in columns]
        if missing:
            raise ValueError(f"{type(self).__name__} conditions on the dataset columns {missing}; none were given")
        if not self._warned_long_prompts:
            self._warned_long_prompts = warn_long_prompts(self.pipeline, prompts, self.settings.max_sequence_length)
        return self._trimmed(self._encode_prompts(prompts, **columns))

    def _encode_prompts(self, prompts: list[str], **columns: list) -> Conditioning:
        """:meth:`encode_prompts` before the text padding is trimmed: :meth:`_encode` and :meth:`_encode_columns`
        (a family that reads a prompt with its images overrides this)."""
        with self._text_encoders_on_device():
            cond = self._encode(prompts)
        return {**cond, **self._encode_columns(**{name: columns[name] for name in self.condition_columns})}

    def _trimmed(self, cond: Conditioning) -> Conditioning:
        """``cond`` with the :attr:`padded_text` entries' padding trimmed (see there); read on the host, once per
        encoding, outside the denoising loop."""
        if not self.runtime.trim_text:
            return cond
        return trim_padded_text(cond, self.padded_text, TEXT_LENGTH_MULTIPLE)

    def _encode_columns(self, **columns: list) -> Conditioning:
        """Conditioning from :attr:`condition_columns` (none by default); shared by both CFG branches."""
        return {}

    @abstractmethod
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        """The pipeline's ``encode_prompt`` on ``prompts``; with ``negative``, its unconditional embeddings instead."""

    def negative_conditioning(self) -> Conditioning:
        """Conditioning of CFG's unconditional branch, first dimension 1: the pipeline's own (the empty prompt; zeros
        for SDXL base), or ``settings.negative_prompt``, which pipelines encode like any prompt."""
        if not self.supports_cfg:
            raise NotImplementedError(f"{type(self).__name__} does not use classifier-free guidance")
        with self._text_encoders_on_device():
            if self.settings.negative_prompt is None:
                return self._trimmed(self._encode([""], negative=True))
            return self._trimmed(self._encode([self.settings.negative_prompt]))

    def _negative_cond(self, batch: int, cond: Conditioning) -> Conditioning:
        """The unconditional branch's conditioning of a batch of ``batch`` samples with conditioning ``cond`` (keys
        it lacks are taken from ``cond``). By default :meth:`negative_conditioning`, encoded once and expanded to the
        batch (no copy); a family whose negative depends on the sample (its source image) overrides this."""
        if self._negative is None or next(iter(self._negative.values())).device != self.device:
            with torch.no_grad():
                self._negative = self.negative_conditioning()
        return {key: value.expand(batch, *value.shape[1:]) for key, value in self._negative.items()}

    # --- sampling: the steps, the prediction, the transition ----------------------------------------------------

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, ...) float32 starting latents, sample ``b`` drawn from ``generators[b]``."""
        settings = self.settings
        return self.pipeline.prepare_latents(
            len(generators), self.denoiser.config.in_channels, settings.height, settings.width, torch.float32,
            self.device, generators,
        )  # fmt: skip

    @property
    def use_cfg(self) -> bool:
        return self.supports_cfg and self.settings.guidance_scale > 1.0

    @property
    def guidance_scale(self) -> float:
        """The CFG scale of the trained denoiser's steps."""
        return self.settings.guidance_scale

    def trained_denoiser_steps(self) -> list[int]:
        """Indices of the steps the trained denoiser serves: all N, or the trained expert's (two-expert Wan 2.2)."""
        return list(range(self.num_steps))

    def trainable_steps(self) -> list[int]:
        """Indices of the steps whose transition depends on the trained denoiser and has a log-probability: the
        first N − 1 (the last step's Gaussian is too sharp to train), or the trained expert's among them."""
        return [i for i in self.trained_denoiser_steps() if i < self.num_steps - 1]

    def check_schedule(self) -> None:
        """Raise ``ValueError`` if one of :meth:`trainable_steps` has zero noise (see
        :meth:`DiffusionProcess.check_schedule`)."""
        self.process.check_schedule(self.trainable_steps())

    def predict(
        self,
        model: torch.nn.Module,
        latents: torch.Tensor,
        cond: Conditioning,
        *,
        at: At,
        guidance_scale: float | None = None,
    ) -> torch.Tensor:
        """The network output a step uses (velocity or ε), CFG-combined ``u + w (c − u)`` when CFG is on.

        Both CFG branches go through one batched forward, so the training loss differentiates through both.

        Args:
            model: the trained denoiser, possibly wrapped (DDP, DeepSpeed); called through :meth:`_guided`.
            latents: (B, ...) float32 latents at ``at``.
            cond: conditioning of each of the B samples.
            at: a step (``int`` for the batch, or (B,) long) or a time (``float`` for the batch, or (B,) float) of
                :attr:`process` (see :data:`At`). Where a policy has several experts, a host-side ``int``/``float``
                picks the one that serves it (``model`` for the trained one); per-sample tensors must be the trained
                expert's.
            guidance_scale: the CFG scale, instead of the serving denoiser's.

        Returns:
            (B, ...) float32.
        """
        model, expert_scale = self._serving(model, at)
        timestep = self._timestep(at, latents)
        return self._guided(model, latents, timestep, cond, expert_scale if guidance_scale is None else guidance_scale)

    def _serving(self, model: torch.nn.Module, at: At) -> tuple[torch.nn.Module, float | None]:
        """The denoiser that serves ``at`` and its CFG scale (None: the trained one's); ``model`` by default."""
        return model, None

    def _timestep(self, at: At, latents: torch.Tensor) -> torch.Tensor:
        """(B,) the denoiser's timestep input at ``at``."""
        if not isinstance(at, torch.Tensor):
            dtype = torch.long if isinstance(at, int) else torch.float32
            at = torch.full((latents.shape[0],), at, device=latents.device, dtype=dtype)
        return self.process.timestep_at(at) if at.is_floating_point() else self.process.model_timestep(at)

    def _guided(
        self,
        model: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float | None = None,
    ) -> torch.Tensor:
        """The output at model timesteps (B,) with the trained denoiser's CFG scale unless ``guidance_scale`` is
        given; a family with its own guidance terms (LTX-2) overrides this."""
        if not self.use_cfg:
            return self._call(model, latents, timestep, cond)
        scale = self.guidance_scale if guidance_scale is None else guidance_scale
        uncond, text = self._call(model, *self._both_branches(latents, timestep, cond)).chunk(2)
        return self.combine_guidance(uncond, text, scale)

    def combine_guidance(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        """CFG's combination of the two branches' outputs (B, ...): ``u + w (c − u)``; a family whose pipeline
        rescales it (Qwen-Image) overrides this."""
        return uncond + scale * (cond - uncond)

    def _both_branches(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning
    ) -> tuple[torch.Tensor, torch.Tensor, Conditioning]:
        """CFG's one batched forward: latents (2B, ...), timesteps (2B,) and conditioning, the unconditional branch
        first. Per-sample extras the negative lacks (e.g. SDXL micro-conditioning) are shared by both branches; a
        per-sample negative's own entries (``negative_*``, editing) are not model inputs."""
        negative = self._negative_cond(latents.shape[0], cond)
        padded = {*self.padded_text, *self.padded_text.values()}  # trimmed to each branch's own longest prompt
        both = {
            key: cat_padded([negative.get(key, value), value])
            if key in padded
            else torch.cat([negative.get(key, value), value])
            for key, value in cond.items()
            if not key.startswith("negative_")
        }
        return torch.cat([latents, latents]), torch.cat([timestep, timestep]), both

    def _call(
        self, model: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning, **options
    ) -> torch.Tensor:
        """:meth:`_forward` (with a family's ``options``) in at least float32, its gradient scaled by
        ``runtime.gradient_scale``."""
        output = _at_least_float32(self._forward(model, latents, timestep, cond, **options))
        scale = self.runtime.gradient_scale
        return output if scale == 1 else scale_gradient(output, scale)

    @abstractmethod
    def _forward(
        self, model: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """One call of the denoiser on a batch (no CFG combination)."""

    def step(
        self, model_output: torch.Tensor, latents: torch.Tensor, step_index: torch.Tensor, **options
    ) -> SDEStepOutput:
        """The transition from ``step_index`` to ``step_index + 1``: :meth:`DiffusionProcess.step` (``options``:
        ``prev_sample``, ``generator``, ``compute_log_prob``, ``noise``, ``eta``), on the latents the policy samples
        (Wan 2.2 TI2V holds its given first frame out); log-probabilities per stream (B, S) with
        ``runtime.stream_log_probs``."""
        segments = tuple(self.streams.values()) if self.runtime.stream_log_probs else None
        return self.process.step(model_output, latents, step_index, segments=segments, **options)

    @property
    def streams(self) -> dict[str, int] | None:
        """The modality streams of a sample's latents, by name, with their element counts in the flattened latent's
        order (LTX-2: ``{"video": ..., "audio": ...}``); None for one-stream families."""
        return getattr(self.layout, "streams", None)

    # --- FLOPs and context parallelism -------------------------------------------------------------------------

    def flop_tokens(self, inputs: dict[str, object]) -> dict[str, int]:
        """Per-sample token counts of :attr:`flop_layout`'s streams in a denoiser call with named ``inputs`` (see
        :func:`trl_dance.flops.denoiser_tokens`)."""
        return denoiser_tokens(inputs, self.denoiser.config)

    def context_parallel_lengths(self) -> dict[str, int]:
        """The token counts per sample the denoiser's context-parallel plan splits, by what they are (they must divide
        by the group size); a family without a plan in trl-dance raises."""
        raise NotImplementedError(f"{type(self).__name__} does not support context parallelism")

    def context_parallel_hint(self) -> str:
        """What to change for :meth:`context_parallel_lengths` to divide (for errors)."""
        return "height/width"

    def context_parallel_plan(self) -> dict | None:
        """The diffusers context-parallel plan of the denoiser (None: the model class's own ``_cp_plan``)."""
        return None

    def prepare_context_parallel(self, model: torch.nn.Module, size: int) -> None:  # noqa: B027 (optional hook)
        """Anything a family's plan cannot express, done to each split ``model`` after ``enable_parallelism``."""

    # --- pixels ------------------------------------------------------------------------------------------------

    def encode_images(
        self, images: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None = None
    ) -> torch.Tensor:
        """Images (B, 3, H, W) in [-1, 1] (videos: (B, F, 3, H, W)) to the policy's latents (B, ...) float32, the
        inverse of :meth:`decode`; the VAE posterior's sample drawn from ``generator`` (or one per image)."""
        return self.layout.encode(images, generator, self.device)

    def final_latents(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The latents to decode after the sampler's last step (the same by default; Wan 2.2 TI2V image-to-video puts
        the given first frame back)."""
        return latents

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents to images: (B, 3, H, W) float32 in [0, 1] (videos: (B, F, 3, H, W))."""
        return self.layout.decode(latents, clamp=not self.runtime.unclamped_decode)

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Families with :attr:`has_audio`: the soundtracks (B, channels, samples) float32 of final latents, at
        :attr:`audio_sample_rate` Hz."""
        raise NotImplementedError(f"{type(self).__name__} generates no audio")

    @contextlib.contextmanager
    def unclamped_decode(self):
        """:meth:`decode` of images without the final clamp to [0, 1], for scorers that resize before they clamp
        (SPO's step-aware preference model); videos are unaffected."""
        self.runtime.unclamped_decode = True
        try:
            yield
        finally:
            self.runtime.unclamped_decode = False


def grouped_forward(keys: list, forward: Callable[[object, list[int]], torch.Tensor]) -> torch.Tensor:
    """``forward(key, rows)`` once per distinct key, over the batch rows (a list of indices) that hold it, the results
    put back in row order: (B, ...) for B = ``len(keys)``. For denoisers that take one layout per call (a prompt
    length, a step: Qwen-Image 2.1, MiniMax-H3); a single key is one call and no copy."""
    output = None
    for key in dict.fromkeys(keys):
        rows = [index for index, other in enumerate(keys) if other == key]
        result = forward(key, rows)
        if len(rows) == len(keys):
            return result
        if output is None:
            output = result.new_empty(len(keys), *result.shape[1:])
        output[torch.tensor(rows, device=result.device)] = result
    return output


def step_after_given(
    step: Callable[..., SDEStepOutput],
    model_output: torch.Tensor,
    latents: torch.Tensor,
    step_index: torch.Tensor,
    given: int,
    dim: int,
    **options,
) -> SDEStepOutput:
    """``step`` (a policy's transition) on the elements after the first ``given`` along ``dim`` of the latents: a given
    part (image-to-video's first frame, put back in every input) carries over unchanged, neither drawn nor scored."""

    def rest(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(dim, given, tensor.shape[dim] - given)

    for name in ("prev_sample", "noise"):
        if options.get(name) is not None:
            options[name] = rest(options[name])
    out = step(rest(model_output), rest(latents), step_index, **options)
    first = latents.narrow(dim, 0, given).float()
    return SDEStepOutput(
        prev_sample=torch.cat([first, out.prev_sample], dim=dim),
        log_prob=out.log_prob,
        mean=torch.cat([first, out.mean], dim=dim),
        std=out.std,
    )
