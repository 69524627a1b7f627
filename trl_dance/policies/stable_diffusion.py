"""Stable Diffusion 1.x/2.x and SDXL (ε- or v-prediction UNets) sampled with DDIM-η steps (DDPO), CFG in the loss."""

from __future__ import annotations

import math

import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from diffusers.utils.torch_utils import randn_tensor

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning, DiffusionPolicy, SamplerSettings
from .process import VPProcess


class StableDiffusionPolicy(DiffusionPolicy):
    """Policy over a :class:`~diffusers.StableDiffusionPipeline`; latents are (B, 4, H/8, W/8).

    Steps follow a ``DDIMScheduler`` built from the pipeline's scheduler config (whatever scheduler it ships: PNDM for
    SD1.5, Euler for SDXL), with ``eta`` as DDIM's η (1.0 in DDPO), and start from DDIM's unit-variance noise.
    The UNet's ``prediction_type`` (ε; v for SD 2.x 768; x0) is read from that config and converted in every step. With
    ``guidance_scale > 1`` the output used in sampling and in the loss is the CFG combination of both branches.
    """

    denoiser_name = "unet"
    process_class = VPProcess
    pipeline: StableDiffusionPipeline

    def __init__(self, pipeline: StableDiffusionPipeline, settings: SamplerSettings):
        super().__init__(pipeline, settings)
        self.flop_layout = self._unet_flop_layout(len(pipeline.unet.config.down_block_types))

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        # The pipeline's prepare_latents scales by the shipped scheduler's init_noise_sigma (SDXL's Euler: 14.6); the
        # policy samples with DDIM, whose initial noise has unit variance.
        scale = self.pipeline.vae_scale_factor
        shape = (len(generators), self.denoiser.config.in_channels)
        shape += (self.settings.height // scale, self.settings.width // scale)
        noise = randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)
        return noise * self.process.scheduler.init_noise_sigma

    @staticmethod
    def _unet_flop_layout(depth: int) -> FlopLayout:
        """The UNet's streams: its resolution levels ``level<l>`` (the latent downsampled 2^l times) for ``depth``
        down and up blocks; a downsampler writes the next level, an upsampler the previous one."""
        streams = [(r"time_embedding|add_embedding|time_emb_proj", SAMPLE), (r"attn2\.to_[kv]$", "text")]
        attention = []
        for i in range(depth):
            streams.append((rf"^down_blocks\.{i}\.downsamplers", f"level{i + 1}"))
            streams.append((rf"^up_blocks\.{i}\.upsamplers", f"level{depth - 2 - i}"))
            for prefix, level in ((rf"^down_blocks\.{i}\.", i), (rf"^up_blocks\.{i}\.", depth - 1 - i)):
                streams.append((prefix, f"level{level}"))
                attention += [(prefix + r".*attn1$", f"level{level}", f"level{level}")]
                attention += [(prefix + r".*attn2$", f"level{level}", "text")]
        streams.append((r"^mid_block", f"level{depth - 1}"))
        attention += [(r"^mid_block.*attn1$", f"level{depth - 1}", f"level{depth - 1}")]
        attention += [(r"^mid_block.*attn2$", f"level{depth - 1}", "text")]
        return FlopLayout(tuple(streams), tuple(attention), default="level0")

    def flop_tokens(self, inputs: dict[str, object]) -> dict[str, int]:
        height, width = inputs["sample"].shape[-2:]
        levels = {f"level{i}": math.ceil(height / 2**i) * math.ceil(width / 2**i) for i in range(8)}
        return {**levels, "text": inputs["encoder_hidden_states"].shape[1], SAMPLE: 1}

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        embeds, negative_embeds = self.pipeline.encode_prompt(prompts, self.device, 1, negative)
        return {"prompt_embeds": negative_embeds if negative else embeds}

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        dtype = self.denoiser.dtype
        return model(
            latents.to(dtype), timestep, encoder_hidden_states=cond["prompt_embeds"].to(dtype), return_dict=False
        )[0]


class StableDiffusionXLPolicy(StableDiffusionPolicy):
    """Policy over a :class:`~diffusers.StableDiffusionXLPipeline`: two text encoders, pooled embeddings and the
    micro-conditioning ``add_time_ids`` = (original H, W, crop top, left, target H, W): ``(H, W, 0, 0, H, W)`` for
    generated samples, or per sample from ``cond["time_ids"]`` (B, 6) when given (Diffusion-DPO's crops)."""

    pipeline: StableDiffusionXLPipeline
    batch_conditions = ("time_ids",)

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        embeds, negative_embeds, pooled, negative_pooled = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=negative
        )
        if negative:  # zeros when the pipeline's config sets force_zeros_for_empty_prompt (SDXL base)
            return {"prompt_embeds": negative_embeds, "pooled_prompt_embeds": negative_pooled}
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def _time_ids(self, batch: int, device: torch.device) -> torch.Tensor:
        """The generated-sample micro-conditioning (H, W, 0, 0, H, W), built once per device, expanded to (B, 6)."""
        cached = getattr(self, "_default_time_ids", None)
        if cached is None or cached.device != device:
            size = (self.settings.height, self.settings.width)
            encoder_2 = self.pipeline.text_encoder_2
            projection_dim = encoder_2.config.projection_dim if encoder_2 is not None else None
            time_ids = self.pipeline._get_add_time_ids(size, (0, 0), size, torch.float32, projection_dim)
            self._default_time_ids = cached = time_ids.to(device)
        return cached.expand(batch, -1)

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        dtype = self.denoiser.dtype
        added = {
            "text_embeds": cond["pooled_prompt_embeds"].to(dtype),
            "time_ids": (
                cond["time_ids"] if "time_ids" in cond else self._time_ids(latents.shape[0], latents.device)
            ).to(dtype),
        }
        return model(
            latents.to(dtype),
            timestep,
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            added_cond_kwargs=added,
            return_dict=False,
        )[0]
