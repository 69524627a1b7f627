"""FLUX (guidance-distilled rectified flow): guidance embedding, no CFG, 2×2-packed latents."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from .base import Conditioning, SamplerSettings
from .flow_matching import FlowMatchingPolicy


class FluxPolicy(FlowMatchingPolicy):
    """Policy over a :class:`~diffusers.FluxPipeline`. Latents are packed tokens: (B, H/16 · W/16, 4 · C).

    FLUX.1-dev is guidance-distilled: ``guidance_scale`` feeds its guidance embedding and sampling uses no CFG.
    """

    supports_cfg = False

    def __init__(self, pipeline: FluxPipeline, settings: SamplerSettings):
        scale = pipeline.vae_scale_factor
        # Needed by _scheduler_kwargs, which the base constructor calls.
        self._latent_hw = (2 * (settings.height // (2 * scale)), 2 * (settings.width // (2 * scale)))
        self.latent_channels = pipeline.transformer.config.in_channels // 4
        super().__init__(pipeline, settings)

    def _scheduler_kwargs(self) -> dict:
        # FluxPipeline sets the unshifted sigmas linspace(1, 1/N, N), not the scheduler's default grid (which ends
        # at the last training sigma), then shifts them with mu.
        steps = self.settings.num_inference_steps
        kwargs = {"sigmas": np.linspace(1.0, 1 / steps, steps)}
        config = self.pipeline.scheduler.config
        if not config.get("use_dynamic_shifting", False):
            return kwargs
        seq_len = (self._latent_hw[0] // 2) * (self._latent_hw[1] // 2)
        mu = calculate_shift(
            seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return {**kwargs, "mu": mu}

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        prompt_embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=prompts,
            device=self.device,
            max_sequence_length=self.settings.max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        latents, _ = self.pipeline.prepare_latents(
            len(generators),
            self.latent_channels,
            self.settings.height,
            self.settings.width,
            torch.float32,
            self.device,
            generators,
        )
        return latents

    def timestep_from_sigma(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma  # the FLUX transformer takes σ (= diffusers timestep / 1000)

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        batch, device, dtype = latents.shape[0], latents.device, self.denoiser.dtype
        h, w = self._latent_hw
        img_ids = self.pipeline._prepare_latent_image_ids(batch, h // 2, w // 2, device, dtype)
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

    def encode_images(
        self, images: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None = None
    ) -> torch.Tensor:
        latents = super().encode_images(images, generator)
        batch, channels, height, width = latents.shape
        return self.pipeline._pack_latents(latents, batch, channels, height, width)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        unpacked = self.pipeline._unpack_latents(
            latents, self.settings.height, self.settings.width, self.pipeline.vae_scale_factor
        )
        return super().decode(unpacked)
