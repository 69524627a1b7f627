"""Qwen-Image (rectified flow, MMDiT on a Qwen2.5-VL text encoder): true CFG with a negative prompt and norm-rescaled
guidance, 2×2-packed latents of a Wan-style VAE."""

from __future__ import annotations

import torch

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning
from .flux import FluxPolicy


class QwenImagePolicy(FluxPolicy):
    """Policy over a :class:`~diffusers.QwenImagePipeline`. Latents are packed tokens (B, H/16 · W/16, 4 · C) as in
    FLUX, with FLUX's resolution-dependent schedule shift.

    ``guidance_scale`` is the pipeline's ``true_cfg_scale``: CFG through both branches against the negative prompt
    (the pipeline's default negative is a prompt too; ``negative_prompt=None`` here means the empty prompt, which
    the pipeline needs spelled out as ``negative_prompt=""``), with the branch combination rescaled to the
    conditional prediction's norm per token. Prompt embeddings are padded to ``max_sequence_length`` with a mask
    (the transformer masks them out of attention; text positions do not depend on the padding), so conditioning of
    different batches stacks.
    """

    masks_text = True
    flop_layout = FlopLayout(
        streams=(
            (r"time_text_embed|_mod\.|norm\w*\.linear", SAMPLE),
            (r"txt_in|add_[qkv]_proj|to_add_out|txt_mlp", "text"),
        ),
        attention=((r"transformer_blocks", "image+text", "image+text"),),
    )

    def context_parallel_lengths(self) -> dict[str, int]:
        # diffusers' plan splits image and text tokens and each block's text mask (checked against one process).
        h, w = self._latent_hw
        return {"image tokens": (h // 2) * (w // 2), "text tokens": self.settings.max_sequence_length}

    supports_cfg = True

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        length = self.settings.max_sequence_length
        embeds, mask = self.pipeline.encode_prompt(prompts, device=self.device, max_sequence_length=length)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        pad = length - embeds.shape[1]
        return {
            "prompt_embeds": torch.nn.functional.pad(embeds, (0, 0, 0, pad)),
            "prompt_embeds_mask": torch.nn.functional.pad(mask, (0, pad)),
        }

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        dtype = self.denoiser.dtype
        h, w = self._latent_hw
        return model(
            hidden_states=latents.to(dtype),
            timestep=timestep.to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_hidden_states_mask=cond["prompt_embeds_mask"],
            img_shapes=[[(1, h // 2, w // 2)]] * latents.shape[0],
            return_dict=False,
        )[0]

    def combine_guidance(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        combined = super().combine_guidance(uncond, cond, scale)
        return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))

    def encode_images(
        self, images: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None = None
    ) -> torch.Tensor:
        latents = super(FluxPolicy, self).encode_images(images.unsqueeze(2), generator)  # (B, C, 1, h, w)
        batch, channels, _, height, width = latents.shape
        return self.pipeline._pack_latents(latents, batch, channels, height, width)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        unpacked = self.pipeline._unpack_latents(
            latents, self.settings.height, self.settings.width, self.pipeline.vae_scale_factor
        )  # (B, C, 1, h, w)
        return super(FluxPolicy, self).decode(unpacked)

    def _postprocess(self, decoded: torch.Tensor) -> torch.Tensor:
        return super()._postprocess(decoded[:, :, 0])  # the one frame of the video VAE
