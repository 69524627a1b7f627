"""Qwen-Image 2.1 (single-stream, block-causal rectified-flow transformer on a Qwen3-VL text encoder): unpatched
latent tokens (B, H/16 · W/16, C) of a 16× RGBA VAE after the prompt's tokens in one sequence, the sampler's σ grid
shipped with the checkpoint (``sample_sigmas``)."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning, DiffusionPolicy
from .layout import RGBAOneFrameLatents
from .qwen_image import padded_prompt

_SLOT = 4  # latent tokens per image slot of the text encoder's sequence (a 2×2 group)


def resampled_sigmas(grid: list[float], steps: int) -> np.ndarray:
    """``steps`` noise levels along a shipped σ grid (without its terminal 0): the grid itself at its own length,
    else the grid linearly interpolated at ``steps`` evenly spaced fractional indices (first and last kept)."""
    grid = np.asarray(grid, dtype=np.float64)
    if steps == len(grid):
        return grid
    return np.interp(np.linspace(0, len(grid) - 1, steps), np.arange(len(grid)), grid)


class QwenImage21Policy(DiffusionPolicy):
    """Policy over a :class:`~diffusers.QwenImage21Pipeline` (Qwen-Image 2.1, text-to-image).

    The transformer reads one sequence: the prompt's tokens (the Qwen3-VL encoder's last layer before its final norm,
    system prefix dropped), then the image's latent tokens; text is causal, the image block bidirectional, and the
    text's length, padding included, moves the image's rotary position (the frame axis continues from the last text
    token). The pipeline pads a batch's prompts to its longest one, so a prompt's image depends on the prompts it is
    encoded with (by ~1e-3 in diffusers' own test); the policy reproduces that: the prompts encoded together are
    padded to their longest (``prompt_length``, stored per sample), and each forward runs the samples of one stored
    length together at that length, whatever they are batched with afterwards (rollout and training batch differently:
    this keeps the ratio at 1). A prompt encoded alone is the pipeline's single-prompt result. The conditioning is kept
    padded to ``max_sequence_length`` with a mask so batches stack; forwards read the lengths on the host (the
    transformer builds its positions on the host every call anyway).

    Sampling: the σ grid is the checkpoint's ``sample_sigmas`` (with ``sigma_schedule="pipeline"``; at another
    ``num_inference_steps`` the grid interpolated to that many steps), shifted by the scheduler for the image's token
    count as the pipeline does. ``guidance_scale`` is the pipeline's ``true_cfg_scale`` (CFG ``u + s (c − u)``
    against the empty prompt or ``negative_prompt``). The pipeline caches the prompt's keys and values after its
    first step (``use_kv_cache``); the policy recomputes them (the same values up to rounding), since training
    forwards need them with gradients. The VAE decodes RGBA: images are its RGB channels (what ``.convert("RGB")``
    of the pipeline's output gives), and images to encode (Diffusion-DPO) get an opaque alpha channel.
    """

    pipeline: QwenImage21Pipeline
    masks_text = True
    supports_cfg = True
    layout_class = RGBAOneFrameLatents
    timestep_units = "sigma"  # the transformer takes σ (the pipeline's timestep / 1000)
    flop_layout = FlopLayout(
        streams=(
            (r"time_text_embed|^modulation|norm_out\.linear", SAMPLE),
            (r"^txt_in", "text"),
            (r"^img_in", "image"),
        ),
        # Text queries against the text keys (causal, computed whole), image queries against all keys: one product
        # over the (query, key) pairs that flop_tokens counts.
        attention=((r"transformer_blocks", "one", "pairs"),),
        default="image+text",  # the blocks and proj_out read the joint sequence
    )

    def _scheduler_kwargs(self) -> dict:
        steps, config = self.settings.num_inference_steps, self.pipeline.scheduler.config
        grid = self.pipeline.config.get("sample_sigmas")
        sigmas = resampled_sigmas(grid, steps) if grid else np.linspace(1.0, 1 / steps, steps)
        h, w = self.layout.latent_hw
        mu = calculate_shift(
            h * w,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return {"sigmas": sigmas, "mu": mu}

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        embeds, mask, _ = self.pipeline.encode_prompt(list(prompts), device=self.device)  # padded to the longest
        batch, length = embeds.shape[:2]
        if length > self.settings.max_sequence_length:
            raise ValueError(
                f"a prompt is {length} tokens after Qwen-Image 2.1's template, more than max_sequence_length "
                f"({self.settings.max_sequence_length}): raise it"
            )
        return padded_prompt(embeds, mask, self.settings.max_sequence_length) | {
            "prompt_length": torch.full((batch,), length, device=embeds.device)
        }

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        settings = self.settings
        latents, _ = self.pipeline.prepare_latents(
            None,
            len(generators),
            self.denoiser.config.in_channels,
            settings.height,
            settings.width,
            torch.float32,
            self.device,
            generators,
        )
        return latents

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        dtype, (h, w) = self.denoiser.dtype, self.layout.latent_hw
        tokens = latents.shape[1]
        lengths = cond["prompt_length"].tolist()
        output = None
        for length in sorted(set(lengths)):
            rows = [index for index, value in enumerate(lengths) if value == length]
            index = torch.tensor(rows, device=latents.device)
            mask = cond["prompt_embeds_mask"][index, :length]
            slots = torch.zeros(len(rows), length + tokens // _SLOT, dtype=torch.bool, device=latents.device)
            slots[:, length:] = True  # the image's slots after the (padded) prompt
            velocity = model(
                hidden_states=latents[index].to(dtype),
                timestep=timestep[index].to(dtype),
                encoder_hidden_states=cond["prompt_embeds"][index, :length].to(dtype),
                encoder_hidden_states_mask=None if mask.all() else mask,  # (as the pipeline: none without padding)
                img_shapes=[[(1, h, w)]] * len(rows),
                img_mask=slots,
                return_dict=False,
            )[0][:, -tokens:]
            if len(rows) == len(lengths):
                return velocity
            if output is None:
                output = velocity.new_empty(latents.shape[0], *velocity.shape[1:])
            output[index] = velocity
        return output

    def flop_tokens(self, inputs: dict[str, object]) -> dict[str, int]:
        image, batch = inputs["hidden_states"].shape[1], inputs["hidden_states"].shape[0]
        text = inputs["encoder_hidden_states"].shape[1]
        rows = batch + 1 if self.denoiser.config.causal_condition else batch  # + the t = 0 row of the prompt tokens
        pairs = text * text + image * (text + image)
        return {"image": image, "text": text, SAMPLE: rows / batch, "one": 1, "pairs": pairs}
