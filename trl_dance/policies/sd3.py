"""Stable Diffusion 3 / 3.5 (MMDiT rectified flow), with CFG in sampling and in the loss when guidance_scale > 1."""

from __future__ import annotations

import torch
from diffusers import StableDiffusion3Pipeline

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning, DiffusionPolicy


class SD3Policy(DiffusionPolicy):
    """Policy over a :class:`~diffusers.StableDiffusion3Pipeline`; latents are (B, C, H/8, W/8)."""

    pipeline: StableDiffusion3Pipeline
    flop_layout = FlopLayout(
        streams=(
            (r"time_text_embed|norm\w*\.linear", SAMPLE),
            (r"context_embedder|add_[qkv]_proj|to_add_out|ff_context", "text"),
        ),
        # SD3.5's dual-attention blocks add an image-only self-attention (attn2) beside the joint one.
        attention=((r"\.attn2$", "image", "image"), (r"\.attn$", "image+text", "image+text")),
    )

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        embeds, negative_embeds, pooled, negative_pooled = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=prompts,
            prompt_3=prompts,
            device=self.device,
            do_classifier_free_guidance=negative,
            max_sequence_length=self.settings.max_sequence_length,
        )
        if negative:
            return {"prompt_embeds": negative_embeds, "pooled_prompt_embeds": negative_pooled}
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        dtype = self.denoiser.dtype
        return model(
            hidden_states=latents.to(dtype),
            timestep=timestep.to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            pooled_projections=cond["pooled_prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]
