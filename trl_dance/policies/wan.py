"""Wan text-to-video (rectified flow with a UMT5 text encoder and a causal 3D VAE), CFG in sampling and in the loss."""

from __future__ import annotations

import dataclasses

import torch
from diffusers import WanPipeline

from .base import Conditioning, SamplerSettings
from .flow_matching import FlowMatchingPolicy


class WanPolicy(FlowMatchingPolicy):
    """Policy over a :class:`~diffusers.WanPipeline` with one transformer (Wan 2.1 T2V, Wan 2.2 TI2V-5B as T2V).

    Latents are (B, C, F', H/s, W/s) with F' = (F − 1)/t + 1 for the VAE's temporal and spatial factors t, s (4 and 8
    for Wan 2.1); :meth:`decode` returns videos (B, F, 3, H, W) in [0, 1].
    """

    is_video = True
    default_num_frames = 81
    """Wan 2.1's published frame count (5 s at 16 fps), used when ``settings.num_frames`` is None."""

    def __init__(self, pipeline: WanPipeline, settings: SamplerSettings):
        if pipeline.transformer is None or pipeline.transformer_2 is not None:
            raise ValueError(
                "two-expert Wan 2.2 pipelines (transformer_2 / boundary_ratio) are not supported: their high- and "
                "low-noise steps use different transformers; load a single-transformer pipeline"
            )
        if settings.num_frames is None:
            settings = dataclasses.replace(settings, num_frames=self.default_num_frames)
        temporal = pipeline.vae_scale_factor_temporal
        if settings.num_frames < 1 or (settings.num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames must be 1 + a multiple of {temporal} for this VAE, got {settings.num_frames}"
            )
        super().__init__(pipeline, settings)

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        # The base class passes the empty prompt for the negative branch: plain encoding serves both.
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            device=self.device,
            max_sequence_length=self.settings.max_sequence_length,
        )
        return {"prompt_embeds": embeds}

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        return self.pipeline.prepare_latents(
            len(generators),
            self.denoiser.config.in_channels,
            self.settings.height,
            self.settings.width,
            self.settings.num_frames,
            torch.float32,
            self.device,
            generators,
        )

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        if self.pipeline.config.expand_timesteps:
            # Wan 2.2 TI2V takes one timestep per latent token (all equal in text-to-video).
            patch_t, patch_h, patch_w = self.denoiser.config.patch_size
            tokens = (latents.shape[2] // patch_t) * (latents.shape[3] // patch_h) * (latents.shape[4] // patch_w)
            timestep = timestep[:, None].expand(-1, tokens)
        dtype = self.denoiser.dtype
        # The timestep stays float32, as in WanPipeline: the transformer casts it after the sinusoidal projection.
        return model(
            hidden_states=latents.to(dtype),
            timestep=timestep.float(),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def _postprocess(self, decoded: torch.Tensor) -> torch.Tensor:
        return self.pipeline.video_processor.postprocess_video(decoded, output_type="pt")
