"""FLUX (guidance-distilled rectified flow): guidance embedding, no CFG, 2×2-packed latents."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning, DiffusionPolicy, SamplerSettings
from .layout import PackedLatents, PatchifiedLatents


def linear_sigmas_with_shift(config, steps: int, image_seq_len: int) -> dict:
    """``set_timesteps`` arguments of FLUX.1 and Z-Image: the unshifted sigmas linspace(1, 1/N, N) (not the
    scheduler's default grid, which ends at the last training sigma), shifted by ``mu`` from the image's token count
    when the scheduler shifts dynamically (else by its static ``shift``)."""
    kwargs = {"sigmas": np.linspace(1.0, 1 / steps, steps)}
    if not config.get("use_dynamic_shifting", False):
        return kwargs
    mu = calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    return {**kwargs, "mu": mu}


def packed_noise(
    pipeline, settings: SamplerSettings, generators: list[torch.Generator], device: torch.device, leading: tuple = ()
) -> torch.Tensor:
    """(B, tokens, 4C) float32 starting latents of a pipeline with FLUX's packed ``prepare_latents`` (FLUX.1/.2,
    Kontext, Qwen-Image), sample ``b`` drawn from ``generators[b]``; ``leading``: its arguments before the batch size
    (an editing pipeline's source image: ``None``, encoded with the conditions instead)."""
    out = pipeline.prepare_latents(
        *leading, len(generators), pipeline.transformer.config.in_channels // 4, settings.height, settings.width,
        torch.float32, device, generators,
    )  # fmt: skip
    # FLUX.1 and FLUX.2 return (latents, ids), Kontext (latents, image latents, ids, image ids), Qwen-Image latents.
    return out[0] if isinstance(out, tuple) else out


class FluxPolicy(DiffusionPolicy):
    """Policy over a :class:`~diffusers.FluxPipeline`. Latents are packed tokens: (B, H/16 · W/16, 4 · C).

    FLUX.1-dev is guidance-distilled: ``guidance_scale`` feeds its guidance embedding and sampling uses no CFG.
    """

    supports_cfg = False
    layout_class = PackedLatents
    timestep_units = "sigma"  # the FLUX transformer takes σ (= diffusers timestep / 1000)
    flop_layout = FlopLayout(
        streams=(
            (r"time_\w*embed|modulation|norm\w*\.linear", SAMPLE),
            (r"^single_transformer_blocks", "image+text"),  # the single-stream blocks read the joint sequence
            (r"context_embedder|add_[qkv]_proj|to_add_out|ff_context", "text"),
        ),
        attention=((r"transformer_blocks", "image+text", "image+text"),),
    )

    def _scheduler_kwargs(self) -> dict:
        h, w = self.layout.latent_hw
        return linear_sigmas_with_shift(
            self.pipeline.scheduler.config, self.settings.num_inference_steps, h // 2 * w // 2
        )

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        prompt_embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=prompts,
            device=self.device,
            max_sequence_length=self.settings.max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    _leading_latent_args: tuple = ()
    """Arguments of the pipeline's ``prepare_latents`` before the batch size (Kontext: no source image, ``None``)."""

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        return packed_noise(self.pipeline, self.settings, generators, self.device, self._leading_latent_args)

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        batch, device, dtype = latents.shape[0], latents.device, self.denoiser.dtype
        img_ids = self._image_ids(batch, device, dtype)
        txt_ids = torch.zeros(cond["prompt_embeds"].shape[1], 3, device=device, dtype=dtype)
        guidance = None
        if self.denoiser.config.guidance_embeds:
            guidance = torch.full((batch,), self.settings.guidance_scale, device=device, dtype=torch.float32)
        return model(
            hidden_states=latents.to(dtype),
            timestep=timestep.to(dtype),
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]

    def _image_ids(self, batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Position ids (tokens, 3) of the image tokens the transformer reads."""
        h, w = self.layout.latent_hw
        return self.pipeline._prepare_latent_image_ids(batch, h // 2, w // 2, device, dtype)

    def context_parallel_lengths(self) -> dict[str, int]:
        # diffusers' FLUX plan splits the joint sequence's image tokens (with Kontext's source tokens) and text tokens.
        h, w = self.layout.latent_hw
        image = (h // 2) * (w // 2) * (2 if self.condition_columns else 1)
        return {"image tokens": image, "text tokens": self.settings.max_sequence_length}

    def context_parallel_hint(self) -> str:
        return "height/width or max_sequence_length"


class FluxKontextPolicy(FluxPolicy):
    """Policy over a :class:`~diffusers.FluxKontextPipeline` (FLUX.1 Kontext, image editing): each sample is conditioned
    on a source image (dataset column ``image``), whose packed latents follow the noisy latents in the transformer's
    sequence, at position ids with first coordinate 1; the velocity is read on the noisy tokens only.

    The source image is resized to the output size (``height`` × ``width``) and encoded with the VAE's posterior mode,
    as the pipeline does for an image of that size (the pipeline's default ``_auto_resize`` instead picks Kontext's
    preferred resolution nearest the image's aspect ratio: train at that size to match it). Guidance is FLUX's
    embedded guidance (2.5 recommended for Kontext).
    """

    condition_columns = ("image",)
    pipeline_tag = "image-to-image"
    _leading_latent_args = (None,)  # the source image is encoded with the conditions, not with the noise

    def _encode_columns(self, image: list) -> Conditioning:
        pipeline, settings = self.pipeline, self.settings
        pixels = pipeline.image_processor.preprocess(
            pipeline.image_processor.resize(list(image), settings.height, settings.width),
            settings.height,
            settings.width,
        )
        latents = pipeline._encode_vae_image(pixels.to(self.device, pipeline.vae.dtype), generator=None).float()
        batch, channels, height, width = latents.shape
        return {"image_latents": pipeline._pack_latents(latents, batch, channels, height, width)}

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        tokens = latents.shape[1]
        both = torch.cat([latents, cond["image_latents"].to(latents.dtype)], dim=1)
        return super()._forward(model, both, timestep, cond)[:, :tokens]

    def _image_ids(self, batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        ids = super()._image_ids(batch, device, dtype)
        source = ids.clone()
        source[..., 0] = 1  # the source image's tokens: first coordinate 1
        return torch.cat([ids, source])


class Flux2Policy(FluxPolicy):
    """Policy over a :class:`~diffusers.Flux2Pipeline` (FLUX.2): packed tokens of 2×2-patchified VAE latents normalised by
    the VAE's batch-norm statistics, (T, H, W, L) position ids, a Mistral3 text encoder read at three hidden layers,
    embedded guidance, and the pipeline's empirical schedule shift ``compute_empirical_mu``. No CFG (FLUX.2 [dev] is
    guidance-distilled); the prompt embeddings are padded to ``max_sequence_length`` as the pipeline pads them.
    """

    layout_class = PatchifiedLatents

    def __init__(self, pipeline, settings):
        super().__init__(pipeline, settings)
        self._ids: dict[tuple, torch.Tensor] = {}

    def _scheduler_kwargs(self) -> dict:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        steps = self.settings.num_inference_steps
        h, w = self.layout.latent_hw
        seq_len = (h // 2) * (w // 2)
        sigmas = (
            None
            if self.pipeline.scheduler.config.get("use_flow_sigmas", False)
            else np.linspace(1.0, 1 / steps, steps)
        )
        return {"sigmas": sigmas, "mu": compute_empirical_mu(image_seq_len=seq_len, num_steps=steps)}

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.settings.max_sequence_length
        )
        return {"prompt_embeds": embeds}

    def _position_ids(self, kind: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The pipeline's (B, tokens, 4) text or latent position ids, built once per shape and device (host-side)."""
        key = (kind, shape, device)
        if key not in self._ids:
            if kind == "text":
                ids = self.pipeline._prepare_text_ids(torch.empty(shape))
            else:
                ids = self.pipeline._prepare_latent_ids(torch.empty(shape))
            self._ids[key] = ids.to(device)
        return self._ids[key]

    def _latent_ids(self, batch: int, device: torch.device) -> torch.Tensor:
        h, w = self.layout.latent_hw
        return self._position_ids("latent", (batch, 1, h // 2, w // 2), device)

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        batch, device, dtype = latents.shape[0], latents.device, self.denoiser.dtype
        embeds = cond["prompt_embeds"]
        guidance = None
        if self.denoiser.config.guidance_embeds:
            guidance = torch.full((batch,), self.settings.guidance_scale, device=device, dtype=torch.float32)
        return model(
            hidden_states=latents.to(dtype),
            timestep=timestep.to(dtype),
            guidance=guidance,
            encoder_hidden_states=embeds.to(dtype),
            txt_ids=self._position_ids("text", tuple(embeds.shape), device),
            img_ids=self._latent_ids(batch, device),
            return_dict=False,
        )[0]


class Flux2KleinPolicy(Flux2Policy):
    """Policy over a :class:`~diffusers.Flux2KleinPipeline` (FLUX.2 [klein] 4B / 9B): FLUX.2's latents, ids and
    schedule, a Qwen3 text encoder read at hidden layers 9, 18 and 27, and no guidance embedding. The base checkpoints
    (``is_distilled: false``, e.g. FLUX.2-klein-base-4B, the ones made for fine-tuning) sample with true CFG against
    the empty prompt when ``guidance_scale`` > 1, as the pipeline does; the step-distilled ones (FLUX.2-klein-4B,
    4 steps) use none.
    """

    @property
    def supports_cfg(self) -> bool:
        return not self.pipeline.config.get("is_distilled", False)
