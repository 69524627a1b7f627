"""HunyuanVideo (rectified flow, dual/single-stream transformer with embedded guidance, Llama + CLIP text encoders,
causal 3D VAE): text-to-video, and text-to-image as one-frame videos (DanceGRPO's HunyuanVideo-T2I)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from diffusers import HunyuanVideoPipeline

from .base import Conditioning, SamplerSettings
from .flow_matching import FlowMatchingPolicy


class HunyuanVideoPolicy(FlowMatchingPolicy):
    """Policy over a :class:`~diffusers.HunyuanVideoPipeline`. Latents are (B, C, F', H/8, W/8) with F' = (F − 1)/4 + 1;
    :meth:`decode` returns videos (B, F, 3, H, W) in [0, 1]. ``num_frames=1`` is DanceGRPO's text-to-image use of the
    model: a one-frame video, decoded to (B, 1, 3, H, W), which image rewards score as that frame.

    HunyuanVideo is guidance-distilled: ``guidance_scale`` feeds its guidance embedding (× 1000, as the pipeline) and
    sampling uses no CFG (the pipeline's optional ``true_cfg_scale`` is not used). The pipeline's own schedule is the
    unshifted grid linspace(1, 0, N + 1)[:-1], shifted by the scheduler (7 as published).
    """

    supports_cfg = False
    is_video = True
    default_num_frames = 129
    """The pipeline's default frame count (5 s at 24 fps), used when ``settings.num_frames`` is None."""

    def __init__(self, pipeline: HunyuanVideoPipeline, settings: SamplerSettings):
        if settings.num_frames is None:
            settings = dataclasses.replace(settings, num_frames=self.default_num_frames)
        temporal = pipeline.vae_scale_factor_temporal
        if settings.num_frames < 1 or (settings.num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames must be 1 + a multiple of {temporal} for this VAE, got {settings.num_frames}"
            )
        super().__init__(pipeline, settings)

    @property
    def pipeline_tag(self) -> str:
        return "text-to-image" if self.settings.num_frames == 1 else "text-to-video"

    def _scheduler_kwargs(self) -> dict:
        steps = self.settings.num_inference_steps
        return {"sigmas": np.linspace(1.0, 0.0, steps + 1)[:-1]}

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        embeds, pooled, mask = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.settings.max_sequence_length
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "prompt_attention_mask": mask}

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        settings = self.settings
        return self.pipeline.prepare_latents(
            len(generators),
            self.denoiser.config.in_channels,
            settings.height,
            settings.width,
            settings.num_frames,
            torch.float32,
            self.device,
            generators,
        )

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        dtype = self.denoiser.dtype
        guidance = torch.full((latents.shape[0],), self.settings.guidance_scale * 1000.0, device=latents.device)
        return model(
            hidden_states=latents.to(dtype),
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_attention_mask=cond["prompt_attention_mask"],
            pooled_projections=cond["pooled_prompt_embeds"].to(dtype),
            guidance=guidance.to(dtype),
            return_dict=False,
        )[0]

    def _postprocess(self, decoded: torch.Tensor) -> torch.Tensor:
        return self.pipeline.video_processor.postprocess_video(decoded, output_type="pt")
