"""Stable Diffusion 3 / 3.5 (MMDiT rectified flow) with optional CFG through one batched forward."""

from __future__ import annotations

import torch
from diffusers import StableDiffusion3Pipeline

from .base import Conditioning, SamplerSettings
from .flow_matching import FlowMatchingPolicy


class SD3Policy(FlowMatchingPolicy):
    """Policy over a :class:`~diffusers.StableDiffusion3Pipeline`; latents are (B, C, H/8, W/8).

    With ``guidance_scale > 1`` the policy's velocity is the CFG combination ``v_u + w (v_c − v_u)``, in sampling
    and in training alike, so gradients flow through both branches. The unconditional (empty prompt) embedding is
    computed once.
    """

    def __init__(self, pipeline: StableDiffusion3Pipeline, settings: SamplerSettings):
        super().__init__(pipeline, settings)
        self.use_cfg = settings.guidance_scale > 1.0
        self._negative: Conditioning | None = None

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> Conditioning:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=prompts,
            prompt_3=prompts,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.settings.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        return self._encode(prompts)

    def _negative_cond(self, batch: int) -> Conditioning:
        if self._negative is None or self._negative["prompt_embeds"].device != self.device:
            self._negative = self._encode([""])
        return {key: value.expand(batch, *value.shape[1:]) for key, value in self._negative.items()}

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        return self.pipeline.prepare_latents(
            len(generators),
            self.denoiser.config.in_channels,
            self.settings.height,
            self.settings.width,
            torch.float32,
            self.device,
            generators,
        )

    def predict(
        self, model: torch.nn.Module, latents: torch.Tensor, step_index: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        dtype = self.denoiser.dtype
        timestep = self.sigma(step_index) * self.pipeline.scheduler.config.num_train_timesteps
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if self.use_cfg:
            negative = self._negative_cond(latents.shape[0])
            # Pad the shorter sequence so both branches run in one batched forward.
            length = max(embeds.shape[1], negative["prompt_embeds"].shape[1])
            pad = torch.nn.functional.pad
            embeds = torch.cat(
                [
                    pad(negative["prompt_embeds"], (0, 0, 0, length - negative["prompt_embeds"].shape[1])),
                    pad(embeds, (0, 0, 0, length - embeds.shape[1])),
                ]
            )
            pooled = torch.cat([negative["pooled_prompt_embeds"], pooled])
            latents = torch.cat([latents, latents])
            timestep = torch.cat([timestep, timestep])
        output = model(
            hidden_states=latents.to(dtype),
            timestep=timestep.to(dtype),
            encoder_hidden_states=embeds.to(dtype),
            pooled_projections=pooled.to(dtype),
            return_dict=False,
        )[0].float()
        if self.use_cfg:
            uncond, text = output.chunk(2)
            output = uncond + self.settings.guidance_scale * (text - uncond)
        return output

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self._vae_decode(latents)
