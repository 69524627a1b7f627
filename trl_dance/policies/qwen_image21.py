"""Qwen-Image 2.1 (single-stream, block-causal rectified-flow transformer on a Qwen3-VL text encoder): unpatched
latent tokens (B, H/16 · W/16, C) of a 16× RGBA VAE after the prompt's tokens in one sequence, the sampler's σ grid
shipped with the checkpoint (``sample_sigmas``)."""

from __future__ import annotations

import numpy as np
import PIL.Image
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions, calculate_shift

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning, DiffusionPolicy, grouped_forward
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
    optional_condition_columns = ("image",)
    pipeline_defaults = {"output_resolution": 1024}  # (the condition image's resize)
    _image_grid: tuple[int, int, int] | None = None  # the condition images' latent grid (1, h, w)
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

    @property
    def pipeline_tag(self) -> str:
        return "image-to-image" if self.condition_columns else "text-to-image"

    def _encode_prompts(self, prompts: list[str], **columns: list) -> Conditioning:
        """Text-to-image: the prompts encoded together (:meth:`_encode`). Image-conditioned (an ``image`` column):
        each prompt read with its condition image (and its negative's, with CFG), and the image's VAE latents."""
        if not self.condition_columns:
            return super()._encode_prompts(prompts, **columns)
        # (not the text read alone as well: each row's read with its image gives every entry that would)
        with self._text_encoders_on_device():
            rows = [self._read_with_image(prompt, image) for prompt, image in zip(prompts, columns["image"])]
        cond = self._encode_columns(image=columns["image"])  # the images' latents
        return cond | {key: torch.cat([row[key] for row in rows]) for key in rows[0]}

    def _sized(self, image) -> tuple[PIL.Image.Image, tuple[int, int]]:
        """A condition image as the pipeline takes it: RGBA, resized to about ``output_resolution``² pixels at its
        aspect ratio (sides multiples of 32)."""
        image = image if isinstance(image, PIL.Image.Image) else PIL.Image.fromarray(np.asarray(image))
        image = image if image.mode == "RGBA" else image.convert("RGBA")
        area = self.pipeline_options["output_resolution"] ** 2
        width, height = calculate_dimensions(area, image.size[0] / image.size[1])[:2]
        return self.pipeline.image_processor.resize(image, width=width, height=height), (height, width)

    def _read_with_image(self, prompt: str, image) -> Conditioning:
        """One sample's prompt read with its condition image (the image-conditioned template, its vision tokens in
        the slots the transformer fills with the image's latents), and its negative's with CFG."""
        seen = self._sized(image)[0]
        cond, length = {}, self.settings.max_sequence_length
        prompts = {"": prompt} | ({"negative_": self.settings.negative_prompt or ""} if self.use_cfg else {})
        for prefix, text in prompts.items():
            embeds, mask, slots = self.pipeline.encode_prompt(prompt=[text], image=[seen], device=self.device)
            if embeds.shape[1] > length:
                raise ValueError(
                    f"a prompt with its condition image's tokens is {embeds.shape[1]} tokens, more than "
                    f"max_sequence_length ({length}): raise it (the image tokens grow with output_resolution)"
                )
            cond |= padded_prompt(embeds, mask, length, prefix)
            cond[f"{prefix}image_slots"] = torch.nn.functional.pad(slots, (0, length - slots.shape[1]))
            cond[f"{prefix}prompt_length"] = torch.tensor([embeds.shape[1]], device=embeds.device)
        return cond

    def _encode_columns(self, image: list | None = None) -> Conditioning:
        """The condition images' VAE latents (B, h_i·w_i, C), all of one grid (one aspect ratio per run)."""
        if image is None:
            return {}
        pipeline, latents = self.pipeline, []
        for row in image:
            picture, (height, width) = self._sized(row)
            grid = (1, height // pipeline.vae_scale_factor, width // pipeline.vae_scale_factor)
            if self._image_grid not in (None, grid):
                raise ValueError(
                    "the condition images of a run must share one size after resizing (one aspect ratio), so that "
                    f"samples batch: got latent grids {grid} and {self._image_grid}"
                )
            self._image_grid = grid
            pixels = pipeline.image_processor.preprocess(picture, height=height, width=width).unsqueeze(2)
            encoded = pipeline._encode_vae_image(pixels.to(self.device, pipeline.vae.dtype), generator=None)
            latents.append(pipeline._pack_latents(encoded.float(), 1, encoded.shape[1], *encoded.shape[3:]))
        return {"image_latents": torch.cat(latents)}

    def _negative_cond(self, batch: int, cond: Conditioning) -> Conditioning:
        if not self.condition_columns:
            return super()._negative_cond(batch, cond)
        return {key[len("negative_") :]: value for key, value in cond.items() if key.startswith("negative_")}

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
        conditioned = "image_latents" in cond  # the condition image's latents fill its vision tokens' slots
        shapes = [self._image_grid, (1, h, w)] if conditioned else [(1, h, w)]

        def forward(length: int, rows: list[int]) -> torch.Tensor:
            index = torch.tensor(rows, device=latents.device)
            mask = cond["prompt_embeds_mask"][index, :length]
            slots = torch.zeros(len(rows), length + tokens // _SLOT, dtype=torch.bool, device=latents.device)
            slots[:, length:] = True  # the image's slots after the (padded) prompt
            hidden = latents[index]
            if conditioned:
                slots[:, :length] = cond["image_slots"][index, :length]
                hidden = torch.cat([cond["image_latents"][index].to(latents.dtype), hidden], dim=1)
            return model(
                hidden_states=hidden.to(dtype),
                timestep=timestep[index].to(dtype),
                encoder_hidden_states=cond["prompt_embeds"][index, :length].to(dtype),
                encoder_hidden_states_mask=None if mask.all() else mask,  # (as the pipeline: none without padding)
                img_shapes=[shapes] * len(rows),
                img_mask=slots,
                return_dict=False,
            )[0][:, -tokens:]

        return grouped_forward(lengths, forward)

    def flop_tokens(self, inputs: dict[str, object]) -> dict[str, int]:
        image, batch = inputs["hidden_states"].shape[1], inputs["hidden_states"].shape[0]
        text = inputs["encoder_hidden_states"].shape[1]
        rows = batch + 1 if self.denoiser.config.causal_condition else batch  # + the t = 0 row of the prompt tokens
        pairs = text * text + image * (text + image)
        return {"image": image, "text": text, SAMPLE: rows / batch, "one": 1, "pairs": pairs}
