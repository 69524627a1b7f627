"""Z-Image (single-stream rectified-flow DiT on a Qwen3 text encoder): latents (B, C, H/8, W/8) that the transformer
takes as a list of (C, 1, H/8, W/8), a timestep running the other way (1 − σ) and a velocity of the opposite sign."""

from __future__ import annotations

import torch
from diffusers import ZImagePipeline
from diffusers.utils import logging

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning, DiffusionPolicy, SamplerSettings
from .flux import linear_sigmas_with_shift

logger = logging.get_logger(__name__)

_SEQUENCE_MULTIPLE = 32  # the transformer pads each sample's image and caption tokens to a multiple of this


def _padded(tokens: int) -> int:
    return -(-tokens // _SEQUENCE_MULTIPLE) * _SEQUENCE_MULTIPLE


class ZImagePolicy(DiffusionPolicy):
    """Policy over a :class:`~diffusers.ZImagePipeline` (Z-Image, Z-Image-Turbo; 6B).

    ``guidance_scale`` means what it means to the pipeline: CFG runs when it is above 0 (not 1), combining the branches
    as ``c + s (c − u)`` against the empty prompt or ``negative_prompt``; Z-Image-Turbo is step-distilled and samples
    with ``guidance_scale=0`` (no CFG) in 8-9 steps. The pipeline's optional ``cfg_truncation`` and
    ``cfg_normalization`` are not reproduced: the policy matches its defaults (neither applied).

    The prompt embeddings are the text encoder's second-to-last hidden states of the chat-templated prompt, padded
    here to ``max_sequence_length`` with a mask so batches stack; each forward hands the transformer every sample's
    unpadded tokens, as the pipeline does (which reads the mask on the host: Z-Image's list-based transformer pads
    and batches on the host anyway). No context-parallel plan ships for this transformer.
    """

    pipeline: ZImagePipeline
    masks_text = True
    # The pipeline feeds (T − σ·T) / T for the scheduler's timestep σ·T: 1 − σ, in the same float32 operations.
    timestep_units = "one_minus_sigma"
    flop_layout = FlopLayout(
        streams=(
            (r"t_embedder|adaLN_modulation", SAMPLE),
            (r"cap_embedder|context_refiner", "text"),
            (r"^layers\.|all_final_layer", "image+text"),  # the main layers read the joint sequence
        ),
        attention=(
            (r"noise_refiner", "image", "image"),
            (r"context_refiner", "text", "text"),
            (r"^layers\.", "image+text", "image+text"),
        ),
    )

    def __init__(self, pipeline: ZImagePipeline, settings: SamplerSettings):
        super().__init__(pipeline, settings)
        if 0 < settings.guidance_scale <= 1:
            # Other families' "no CFG" (1.0, several methods' default) is CFG here, at twice the cost.
            logger.warning(
                f"guidance_scale {settings.guidance_scale} on Z-Image is classifier-free guidance (c + s (c - u), "
                "both branches): its pipeline turns CFG off at 0, which Z-Image-Turbo samples with"
            )

    @property
    def use_cfg(self) -> bool:
        return self.settings.guidance_scale > 0

    def combine_guidance(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        return cond + scale * (cond - uncond)

    def _scheduler_kwargs(self) -> dict:
        h, w = self.layout.latent_hw
        return linear_sigmas_with_shift(
            self.pipeline.scheduler.config, self.settings.num_inference_steps, (h // 2) * (w // 2)
        )

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        length = self.settings.max_sequence_length
        # A copy: the pipeline writes the chat-templated prompts into the list it is given.
        embeds, _ = self.pipeline.encode_prompt(
            list(prompts), device=self.device, do_classifier_free_guidance=False, max_sequence_length=length
        )
        padded = torch.zeros(len(embeds), length, embeds[0].shape[-1], dtype=embeds[0].dtype, device=self.device)
        mask = torch.zeros(len(embeds), length, dtype=torch.bool, device=self.device)
        for row, tokens in enumerate(embeds):
            padded[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = True
        return {"prompt_embeds": padded, "prompt_embeds_mask": mask}

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        dtype = self.denoiser.dtype
        captions = [tokens[mask].to(dtype) for tokens, mask in zip(cond["prompt_embeds"], cond["prompt_embeds_mask"])]
        frames = list(latents.to(dtype).unsqueeze(2).unbind(0))  # (C, 1, h, w) each: one frame
        output = model(frames, timestep, captions, return_dict=False)[0]
        # The transformer predicts x0 − ε (the pipeline negates it before its Euler step): the velocity is −output.
        return -torch.stack(output).squeeze(2)

    def flop_tokens(self, inputs: dict[str, object]) -> dict[str, int]:
        _, _, height, width = inputs["x"][0].shape
        patch = self.denoiser.config.all_patch_size[0]
        text = max(len(caption) for caption in inputs["cap_feats"])
        return {"image": _padded((height // patch) * (width // patch)), "text": _padded(text), SAMPLE: 1}
