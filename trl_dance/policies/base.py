"""The interface between RL trainers and a diffusers pipeline.

A policy owns the pipeline's frozen parts (text encoders, VAE) and knows the model family's conventions (latent
layout, timestep scaling, conditioning, CFG). It knows nothing about rewards or losses. The trainable denoiser is
passed in to :meth:`DiffusionPolicy.predict` so the trainer can call it through its DDP/DeepSpeed wrapper.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from diffusers import DiffusionPipeline

from ..flops import SAMPLE, FlopLayout
from ..forward_process import UNIFORM, TimeDensity, add_noise, recover_clean
from ..sde import Reduction, SDEStepOutput
from .runtime import PolicyRuntime

logger = logging.getLogger(__name__)

Conditioning = dict[str, torch.Tensor]
"""Prompt conditioning: tensors with the prompt (or sample) as first dimension, indexable per sample."""


@dataclass
class SamplerSettings:
    """How a policy samples. See :class:`~trl_dance.DanceGRPOConfig` for the meaning of each field."""

    num_inference_steps: int = 16
    height: int = 720
    width: int = 720
    guidance_scale: float = 3.5
    eta: float = 0.3
    sde_type: Literal["dance", "flow_grpo", "cps", "flash"] = "dance"
    sigma_schedule: Literal["dance", "pipeline"] = "dance"
    shift: float = 3.0
    max_sequence_length: int = 512
    log_prob_reduction: Reduction = "mean"
    num_frames: int | None = None
    negative_prompt: str | None = None
    guidance_scale_2: float | None = None
    train_expert: Literal["high_noise", "low_noise"] = "high_noise"
    pipeline_kwargs: dict | None = None

    @classmethod
    def from_config(cls, args) -> SamplerSettings:
        """The settings of a rollout trainer's config: its fields of the same names, and the SDE's where the method
        samples with one (``args.sde_settings()``)."""
        names = [name for name in cls.__dataclass_fields__ if name not in ("eta", "sde_type", "log_prob_reduction")]
        return cls(**{name: getattr(args, name) for name in names}, **args.sde_settings())


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_gradient(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """``tensor`` unchanged, its gradient multiplied by ``scale`` in the backward pass."""
    return _ScaleGradient.apply(tensor, scale) if tensor.requires_grad else tensor


def _at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Float32, or float64 for a float64 model (gradient checks): predictions are combined and stepped in it."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class DiffusionPolicy(ABC):
    """A diffusers pipeline seen as a stochastic policy over denoising steps.

    Steps are addressed by integer index ``i ∈ [0, N)``; step ``i`` maps the latent at index ``i`` of the
    trajectory to the one at ``i + 1``.
    """

    denoiser_name: str = "transformer"
    """Attribute of the pipeline holding the trainable denoiser (also the LoRA prefix in ``save_lora_weights``)."""

    supports_cfg: bool = True
    """False for guidance-distilled families (FLUX), whose ``guidance_scale`` feeds an embedding instead."""

    is_video: bool = False
    """True for video families: :meth:`decode` returns (B, F, 3, H, W) and ``settings.num_frames`` applies."""

    has_audio: bool = False
    """True for families that generate a soundtrack with the video (LTX-2): :meth:`decode_audio` returns it, at
    :attr:`audio_sample_rate` Hz."""

    audio_sample_rate: int | None = None

    default_num_frames: int | None = None
    """Video families: the frame count used when ``settings.num_frames`` is None (see :meth:`_with_num_frames`)."""

    condition_columns: tuple[str, ...] = ()
    """Dataset columns the policy conditions on besides the prompt (image-to-video, editing: ``("image",)``)."""

    prediction_type: str = "flow_prediction"
    """What the denoiser predicts, in diffusers' names: ``"flow_prediction"`` (the velocity ε − x0), ``"epsilon"``,
    ``"v_prediction"`` or ``"sample"``."""

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

    def __init__(self, pipeline: DiffusionPipeline, settings: SamplerSettings):
        self.pipeline = pipeline
        self.settings = settings
        self._negative: Conditioning | None = None
        self.runtime = PolicyRuntime()  # the run's settings (the trainer's), shared with every copy
        self._warned_long_prompts = False
        if settings.num_frames is not None and not self.is_video:
            raise ValueError(f"num_frames applies to video pipelines; {type(pipeline).__name__} generates images")
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
        multiple = self._size_multiple(pipeline)
        for name, size in (("height", settings.height), ("width", settings.width)):
            if size % multiple:
                raise ValueError(f"{name}={size} must be a multiple of {multiple} for {type(pipeline).__name__}")

    @staticmethod
    def _size_multiple(pipeline: DiffusionPipeline) -> int:
        """What ``height`` and ``width`` must divide by: the VAE's factor times the transformer's 2×2 patches."""
        return 2 * (getattr(pipeline, "vae_scale_factor", None) or getattr(pipeline, "vae_scale_factor_spatial", 8))

    def _with_num_frames(self, pipeline: DiffusionPipeline, settings: SamplerSettings) -> SamplerSettings:
        """Video families, before ``__init__``: ``settings`` with ``num_frames`` defaulted to
        :attr:`default_num_frames`, checked to be 1 + a multiple of the VAE's temporal factor."""
        if settings.num_frames is None:
            settings = dataclasses.replace(settings, num_frames=self.default_num_frames)
        temporal = getattr(pipeline, "vae_scale_factor_temporal", None) or pipeline.vae_temporal_compression_ratio
        if settings.num_frames < 1 or (settings.num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames must be 1 + a multiple of {temporal} for this VAE, got {settings.num_frames}"
            )
        return settings

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, self.denoiser_name)

    @property
    def lora_name(self) -> str:
        """The denoiser's name in the pipeline's LoRA files (``<lora_name>.`` key prefix)."""
        return self.denoiser_name

    @property
    def num_steps(self) -> int:
        return self.settings.num_inference_steps

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Pipeline modules other than the denoiser: text encoders and VAE, never trained."""
        return [
            module
            for name, module in self.pipeline.components.items()
            if isinstance(module, torch.nn.Module) and name != self.denoiser_name
        ]

    def text_encoders(self) -> list[torch.nn.Module]:
        return [
            module
            for name, module in self.pipeline.components.items()
            if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)
        ]

    @property
    def frozen_expert(self) -> torch.nn.Module | None:
        """The denoiser that serves the steps of the trained one's frozen partner (two-expert Wan 2.2), else None."""
        return None

    def offloaded_modules(self) -> list[torch.nn.Module]:
        """Frozen modules kept on the CPU and moved to the accelerator only while used: the text encoders with
        ``runtime.offload_text_encoders``, the frozen expert with ``runtime.offload_frozen_expert``."""
        offloaded = self.text_encoders() if self.runtime.offload_text_encoders else []
        if self.runtime.offload_frozen_expert and self.frozen_expert is not None:
            offloaded.append(self.frozen_expert)
        return offloaded

    @contextlib.contextmanager
    def sampling(self):
        """Hold around rollouts: with ``runtime.offload_frozen_expert`` the frozen expert is on the accelerator only
        inside. Re-entrant (also across copies of the policy), so a round of several rollout chunks moves it once each
        way."""
        runtime = self.runtime
        module = self.frozen_expert if runtime.offload_frozen_expert else None
        outermost = module is not None and runtime.sampling_depth == 0
        if outermost:
            module.to(self.device)
        runtime.sampling_depth += 1
        try:
            yield
        finally:
            runtime.sampling_depth -= 1
            if outermost:
                module.to("cpu")

    def to(self, device: torch.device | str) -> DiffusionPolicy:
        """Move the frozen modules to ``device`` (the trainer places the denoiser), except
        :meth:`offloaded_modules`, which stay on the CPU."""
        offloaded = self.offloaded_modules()
        for module in self.frozen_modules():
            module.requires_grad_(False).to("cpu" if any(module is m for m in offloaded) else device)
        return self

    @contextlib.contextmanager
    def _text_encoders_on_device(self):
        if not self.runtime.offload_text_encoders:
            yield
            return
        for module in self.text_encoders():
            module.to(self.device)
        try:
            yield
        finally:
            for module in self.text_encoders():
                module.to("cpu")

    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device

    def encode_prompts(self, prompts: list[str], **columns: list) -> Conditioning:
        """Conditioning of each prompt (computed without gradients), first dimension ``len(prompts)``: its text
        embeddings and, for policies with :attr:`condition_columns`, what they encode from those columns' values
        (one per prompt)."""
        missing = [name for name in self.condition_columns if name not in columns]
        if missing:
            raise ValueError(f"{type(self).__name__} conditions on the dataset columns {missing}; none were given")
        if not self._warned_long_prompts:
            self._warn_long_prompts(prompts)
        with self._text_encoders_on_device():
            cond = self._encode(prompts)
        return {**cond, **self._encode_columns(**{name: columns[name] for name in self.condition_columns})}

    def _warn_long_prompts(self, prompts: list[str]) -> None:
        """Warn once if prompts are longer than a text encoder reads (CLIP: 77 tokens; T5: ``max_sequence_length``):
        the pipeline truncates them."""
        for name, tokenizer in self.pipeline.components.items():
            # ByT5 (HunyuanVideo 1.5's glyph encoder) reads only a prompt's quoted text, at its own fixed length.
            if not name.startswith("tokenizer") or tokenizer is None or type(tokenizer).__name__ == "ByT5Tokenizer":
                continue
            clip = "CLIP" in type(tokenizer).__name__
            limit = tokenizer.model_max_length if clip else self.settings.max_sequence_length
            lengths = [len(ids) for ids in tokenizer(prompts, truncation=False)["input_ids"]]
            over = [(length, prompt) for length, prompt in zip(lengths, prompts) if length > limit]
            if over:
                self._warned_long_prompts = True
                length, prompt = max(over)
                logger.warning(
                    f"{len(over)} of {len(prompts)} prompts are longer than the {limit} tokens {name} "
                    f"({type(tokenizer).__name__}) reads and are truncated, e.g. {prompt[:80]!r}... ({length} tokens)"
                    + ("" if clip else "; raise max_sequence_length to keep more")
                    + ". Warned once."
                )
                return

    def _encode_columns(self, **columns: list) -> Conditioning:
        """Conditioning from :attr:`condition_columns` (none by default); shared by both CFG branches."""
        return {}

    @abstractmethod
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        """The pipeline's ``encode_prompt`` on ``prompts``; with ``negative``, its unconditional embeddings instead."""

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, ...) float32 starting latents, sample ``b`` drawn from ``generators[b]``."""
        return self.pipeline.prepare_latents(
            len(generators),
            self.denoiser.config.in_channels,
            self.settings.height,
            self.settings.width,
            torch.float32,
            self.device,
            generators,
        )

    @property
    def use_cfg(self) -> bool:
        return self.supports_cfg and self.settings.guidance_scale > 1.0

    def trained_denoiser_steps(self) -> list[int]:
        """Indices of the steps the trained denoiser serves: all N, or the trained expert's (two-expert Wan 2.2)."""
        return list(range(self.num_steps))

    def trainable_steps(self) -> list[int]:
        """Indices of the steps whose transition depends on the trained denoiser and has a log-probability: the
        first N − 1 (the last step's Gaussian is too sharp to train), or the trained expert's among them."""
        return [i for i in self.trained_denoiser_steps() if i < self.num_steps - 1]

    def predict(
        self, model: torch.nn.Module, latents: torch.Tensor, step_index: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """The network output the step uses (velocity or ε), CFG-combined ``u + w (c − u)`` when CFG is on.

        Both CFG branches go through one batched forward, so the training loss differentiates through both.

        Args:
            model: the trained denoiser, possibly wrapped (DDP, DeepSpeed); called exactly once.
            latents: (B, ...) float32 latents at ``step_index``.
            step_index: (B,) long, the step of each sample (samples may be at different steps), all among
                :meth:`trainable_steps` when the policy has a frozen expert.
            cond: conditioning of each of the B samples.

        Returns:
            (B, ...) float32.
        """
        return self.predict_at(model, latents, self.model_timestep(step_index), cond)

    def predict_step(
        self, model: torch.nn.Module, latents: torch.Tensor, step: int, step_index: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """:meth:`predict` for a batch all at step ``step`` (the sampler's loop; ``step_index`` is (B,) filled with
        it), where a policy with several experts calls the one that serves the step (``model`` for the trained one):
        the host-side ``step`` picks it without reading the device."""
        return self.predict(model, latents, step_index, cond)

    def predict_at(
        self,
        model: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float | None = None,
    ) -> torch.Tensor:
        """:meth:`predict` at explicit model timesteps (B,), in the units of :meth:`model_timestep`, with the trained
        denoiser's CFG scale unless ``guidance_scale`` is given."""
        if not self.use_cfg:
            return self._call(model, latents, timestep, cond)
        scale = self.guidance_scale if guidance_scale is None else guidance_scale
        uncond, text = self._call(model, *self._both_branches(latents, timestep, cond)).chunk(2)
        return self.combine_guidance(uncond, text, scale)

    def _both_branches(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning
    ) -> tuple[torch.Tensor, torch.Tensor, Conditioning]:
        """CFG's one batched forward: latents (2B, ...), timesteps (2B,) and conditioning, the unconditional branch
        first. Per-sample extras the negative lacks (e.g. SDXL micro-conditioning) are shared by both branches; a
        per-sample negative's own entries (``negative_*``, editing) are not model inputs."""
        negative = self._negative_cond(latents.shape[0], cond)
        both = {
            key: torch.cat([negative.get(key, value), value])
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

    def flop_tokens(self, inputs: dict[str, object]) -> dict[str, int]:
        """Per-sample token counts of :attr:`flop_layout`'s streams in a denoiser call with named ``inputs``: ``image``
        (video) tokens after patching, ``text`` tokens, ``image_embeds`` (an image encoder's tokens, Wan I2V), and
        :data:`~trl_dance.flops.SAMPLE` rows (1, or one per token where the timestep is per token)."""
        hidden = inputs.get("hidden_states", inputs.get("sample"))
        config = self.denoiser.config
        patch = config.get("patch_size") or 1
        if hidden.dim() == 3:  # packed tokens (FLUX, Qwen-Image)
            image = hidden.shape[1]
        elif hidden.dim() == 4:  # (B, C, H, W)
            image = (hidden.shape[2] // patch) * (hidden.shape[3] // patch)
        else:  # (B, C, F, H, W)
            patch_t, patch_h, patch_w = (
                patch if isinstance(patch, (list, tuple)) else (config.get("patch_size_t") or 1, patch, patch)
            )
            image = (hidden.shape[2] // patch_t) * (hidden.shape[3] // patch_h) * (hidden.shape[4] // patch_w)
        tokens = {"image": image, SAMPLE: inputs["timestep"][0].numel()}
        for stream, name in (("text", "encoder_hidden_states"), ("image_embeds", "encoder_hidden_states_image")):
            if isinstance(inputs.get(name), torch.Tensor):
                tokens[stream] = inputs[name].shape[1]
        return tokens

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

    def combine_guidance(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        """CFG's combination of the two branches' outputs (B, ...): ``u + w (c − u)``; a family whose pipeline
        rescales it (Qwen-Image) overrides this."""
        return uncond + scale * (cond - uncond)

    @property
    def guidance_scale(self) -> float:
        """The CFG scale of the trained denoiser's steps."""
        return self.settings.guidance_scale

    @abstractmethod
    def model_timestep(self, step_index: torch.Tensor) -> torch.Tensor:
        """(B,) the timestep each sample's step feeds the denoiser, in the model's own units."""

    @abstractmethod
    def _forward(
        self, model: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """One call of the denoiser on a batch (no CFG combination)."""

    def negative_conditioning(self) -> Conditioning:
        """Conditioning of CFG's unconditional branch, first dimension 1: the pipeline's own (the empty prompt; zeros
        for SDXL base), or ``settings.negative_prompt``, which pipelines encode like any prompt."""
        if not self.supports_cfg:
            raise NotImplementedError(f"{type(self).__name__} does not use classifier-free guidance")
        with self._text_encoders_on_device():
            if self.settings.negative_prompt is None:
                return self._encode([""], negative=True)
            return self._encode([self.settings.negative_prompt])

    def _negative_cond(self, batch: int, cond: Conditioning) -> Conditioning:
        """The unconditional branch's conditioning of a batch of ``batch`` samples with conditioning ``cond`` (keys
        it lacks are taken from ``cond``). By default :meth:`negative_conditioning`, encoded once and expanded to the
        batch (no copy); a family whose negative depends on the sample (its source image) overrides this."""
        if self._negative is None or next(iter(self._negative.values())).device != self.device:
            with torch.no_grad():
                self._negative = self.negative_conditioning()
        return {key: value.expand(batch, *value.shape[1:]) for key, value in self._negative.items()}

    @abstractmethod
    def step(
        self,
        model_output: torch.Tensor,
        latents: torch.Tensor,
        step_index: torch.Tensor,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        compute_log_prob: bool = True,
        noise: torch.Tensor | None = None,
        eta: float | None = None,
    ) -> SDEStepOutput:
        """The stochastic transition from ``step_index`` to ``step_index + 1`` (see :mod:`trl_dance.sde`), at
        ``eta`` (default ``settings.eta``; 0 is the deterministic ODE / DDIM step, without log-prob)."""

    # ------------------------------------------------------------------------------------------------------------
    # The forward process x_t = α_t·x0 + σ_t·ε at a time t ∈ [0, 1] (1: pure noise), for the losses that noise clean
    # latents (Diffusion-DPO, DiffusionNFT, Direct-Align). One implementation per parametrisation
    # (:class:`~trl_dance.policies.FlowMatchingPolicy`, :class:`~trl_dance.policies.StableDiffusionPolicy`); trainers
    # call these and never the scheduler. See :mod:`trl_dance.forward_process`.

    def noise_coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(α_t, σ_t)``, each (B,) float32 on ``t``'s device, at times ``t`` (B,)."""
        raise NotImplementedError(f"{type(self).__name__} does not define its forward process")

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``x_t = α_t·x0 + σ_t·ε``: clean latents ``x0`` (B, ...) noised with ``noise`` (B, ...) to times ``t`` (B,)."""
        return add_noise(x0, noise, *self.noise_coefficients(t))

    def recover_clean(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``(x_t − σ_t·ε)/α_t``: the clean latents of ``latents`` (B, ...) at times ``t`` (B,) < 1 given their known
        noise, the inverse of :meth:`add_noise`."""
        return recover_clean(latents, noise, *self.noise_coefficients(t))

    def training_target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(B, ...) what the denoiser is trained to output at :meth:`add_noise`'s ``x_t`` (flow: ε − x0; ε, v or x0 as
        the model's ``prediction_type``)."""
        raise NotImplementedError(f"{type(self).__name__} does not define its forward process")

    def timestep_at(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) the denoiser's timestep input at times ``t`` (B,), in the model's own units."""
        raise NotImplementedError(f"{type(self).__name__} does not define its forward process")

    def predict_at_time(
        self, model: torch.nn.Module, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """:meth:`predict_at` at times ``t`` (B,) of the forward process."""
        return self.predict_at(model, latents, self.timestep_at(t), cond)

    def sample_training_times(
        self,
        count: int,
        generator: torch.Generator | None,
        device: torch.device | str,
        density: TimeDensity = UNIFORM,
    ) -> torch.Tensor:
        """(count,) float32 times at which the model was trained, as its training script draws them: flow models
        u from ``density`` read on the model's own training grid; ε/v models a uniform training timestep (they ignore
        ``density``)."""
        raise NotImplementedError(f"{type(self).__name__} does not define its forward process")

    def deterministic_step(
        self, model_output: torch.Tensor, latents: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor
    ) -> torch.Tensor:
        """One step of the deterministic sampler from times ``t`` to ``t_next`` (B,), either direction (flow: Euler;
        ε/v: DDIM with η = 0), differentiable in ``model_output`` and ``latents``."""
        raise NotImplementedError(f"{type(self).__name__} does not define its forward process")

    def predicted_clean(
        self, model_output: torch.Tensor, latents: torch.Tensor, step_index: torch.Tensor
    ) -> torch.Tensor:
        """The clean latents x̂0 (B, ...) float32 the network output at ``latents`` of step ``step_index`` predicts
        (SPO's step-aware scorers judge candidates on them)."""
        raise NotImplementedError(f"{type(self).__name__} does not predict clean latents")

    def solve(
        self,
        model: torch.nn.Module,
        latents: torch.Tensor,
        cond: Conditioning,
        sigmas: tuple[float, ...],
        solver: str = "ode",
        previous: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Deterministically solve from ``sigmas[0]`` down the given grid (MixGRPO-Flash's compressed steps after the
        SDE window); flow-matching policies only."""
        raise NotImplementedError(
            f"{type(self).__name__} steps on its scheduler's own grid; a compressed post-window grid needs a "
            "flow-matching policy (FLUX, SD3, Wan)"
        )

    def check_schedule(self) -> None:
        """Raise ``ValueError`` if one of :meth:`trainable_steps` has zero noise, hence no log-probability.

        Checked once, on the CPU, through the same :meth:`step` the sampler uses; the step itself does not check
        its per-sample std, which would cost a host-device sync every step.
        """
        trainable = torch.tensor(self.trainable_steps(), dtype=torch.long)
        if len(trainable) > 0:
            zeros = torch.zeros(len(trainable), 1)
            std = self.step(zeros, zeros, trainable, prev_sample=zeros, compute_log_prob=False).std
            if (std <= 0).any():
                steps = trainable[std <= 0].tolist()
                raise ValueError(
                    f"steps {steps} of the {self.num_steps}-step schedule have zero standard deviation (noise level "
                    f"{self.settings.eta}, sde_type {self.settings.sde_type!r}): their log-probability is "
                    "undefined. Use a positive noise level or a schedule without repeated sigmas."
                )

    def log_prob_gradient_scale(self, steps: list[int]) -> torch.Tensor:
        """(len(steps),) float32: how strongly each step's log-probability responds to the network output,
        |∂μ/∂output| / std for the step's Gaussian mean μ and std (flow: Δσ·(1 + s²(1−σ)/(2σ)) / (s·√Δσ)). On-policy,
        the gradient of a transition's log-prob with respect to the output is this times the step's standard noise,
        so it is the time-dependent scale Flash-GRPO's temporal gradient rectification divides out. Every step is
        affine in the output, so one finite difference on (len(steps), 1) probes is exact."""
        index = torch.tensor(steps, dtype=torch.long)
        zeros, ones = torch.zeros(len(steps), 1), torch.ones(len(steps), 1)
        at_zero = self.step(zeros, zeros, index, prev_sample=zeros, compute_log_prob=False)
        at_one = self.step(ones, zeros, index, prev_sample=zeros, compute_log_prob=False)
        return (at_one.mean - at_zero.mean).abs().flatten() / at_zero.std

    def _latent_affine(self, like: torch.Tensor) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """``(offset, scale)`` with policy latents = (VAE latents − offset) · scale, broadcastable to VAE latents
        ``like`` (B, C, ...): the VAE's per-channel latents_mean/std when its config has them (SDXL, Wan; Wan's
        VAE has no scaling factor), else its shift_factor and scaling_factor."""
        config = self.pipeline.vae.config
        scaling = getattr(config, "scaling_factor", None) or 1.0
        if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
            shape = (1, -1) + (1,) * (like.ndim - 2)
            mean = torch.tensor(config.latents_mean, device=like.device).view(shape)
            std = torch.tensor(config.latents_std, device=like.device).view(shape)
            return mean, scaling / std
        return getattr(config, "shift_factor", None) or 0.0, scaling

    @torch.no_grad()
    def encode_images(
        self, images: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None = None
    ) -> torch.Tensor:
        """Images (B, 3, H, W) in [-1, 1] (videos: (B, F, 3, H, W)) to the policy's latents (B, ...) float32, the
        inverse of :meth:`decode`; the VAE posterior's sample drawn from ``generator`` (or one per image)."""
        vae = self.pipeline.vae
        if self.is_video:  # videos (B, F, 3, H, W); video VAEs take (B, 3, F, H, W)
            images = images.transpose(1, 2)
        latents = vae.encode(images.to(device=self.device, dtype=vae.dtype)).latent_dist.sample(generator).float()
        offset, scale = self._latent_affine(latents)
        return (latents - offset) * scale

    def final_latents(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The latents to decode after the sampler's last step (the same by default; Wan 2.2 TI2V image-to-video puts
        the given first frame back)."""
        return latents

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents to images: (B, 3, H, W) float32 in [0, 1] (videos: (B, F, 3, H, W))."""
        vae = self.pipeline.vae
        offset, scale = self._latent_affine(latents)
        latents = latents / scale + offset
        decoded = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return self._postprocess(decoded).to(torch.promote_types(decoded.dtype, torch.float32))  # float64 stays

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Families with :attr:`has_audio`: the soundtracks (B, channels, samples) float32 of final latents, at
        :attr:`audio_sample_rate` Hz."""
        raise NotImplementedError(f"{type(self).__name__} generates no audio")

    def _postprocess(self, decoded: torch.Tensor) -> torch.Tensor:
        """The VAE's output in [-1, 1] to the pipeline's "pt" output in [0, 1] (not clamped inside
        :meth:`unclamped_decode`)."""
        if getattr(self, "_unclamped", False):
            return decoded / 2 + 0.5
        return self.pipeline.image_processor.postprocess(decoded, output_type="pt")

    @contextlib.contextmanager
    def unclamped_decode(self):
        """:meth:`decode` of images without the final clamp to [0, 1], for scorers that resize before they clamp
        (SPO's step-aware preference model); videos are unaffected."""
        self._unclamped = True
        try:
            yield
        finally:
            self._unclamped = False
