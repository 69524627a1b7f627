"""Qwen-Image (rectified flow, MMDiT on a Qwen2.5-VL text encoder): true CFG with a negative prompt and norm-rescaled
guidance, 2×2-packed latents of a Wan-style VAE; Qwen-Image-Edit(-Plus): source images' latents after the noisy
tokens, and the instruction read with the source images."""

from __future__ import annotations

import torch

from ..flops import SAMPLE, FlopLayout
from .base import Conditioning, DiffusionPolicy
from .flux import linear_sigmas_with_shift, packed_noise
from .layout import OneFrameLatents


def padded_prompt(embeds: torch.Tensor, mask: torch.Tensor | None, length: int, prefix: str = "") -> Conditioning:
    """(B, L, D) prompt embeddings and their (B, L) mask (None: all valid) padded to ``length`` tokens, as the
    conditioning entries ``{prefix}prompt_embeds`` and ``{prefix}prompt_embeds_mask``, so that batches stack."""
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    pad = length - embeds.shape[1]
    return {
        f"{prefix}prompt_embeds": torch.nn.functional.pad(embeds, (0, 0, 0, pad)),
        f"{prefix}prompt_embeds_mask": torch.nn.functional.pad(mask, (0, pad)),
    }


class QwenImagePolicy(DiffusionPolicy):
    """Policy over a :class:`~diffusers.QwenImagePipeline`. Latents are packed tokens (B, H/16 · W/16, 4 · C) as in
    FLUX, with FLUX's resolution-dependent schedule shift.

    ``guidance_scale`` is the pipeline's ``true_cfg_scale``: CFG through both branches against the negative prompt
    (the pipeline's default negative is a prompt too; ``negative_prompt=None`` here means the empty prompt, which
    the pipeline needs spelled out as ``negative_prompt=""``), with the branch combination rescaled to the
    conditional prediction's norm per token. Prompt embeddings are encoded with a mask and trimmed to a batch's longest
    prompt (:attr:`~DiffusionPolicy.padded_text`: the transformer masks padding out of attention and text positions
    count from the first token, so its length changes nothing).
    """

    masks_text = True
    padded_text = {"prompt_embeds": "prompt_embeds_mask", "negative_prompt_embeds": "negative_prompt_embeds_mask"}
    layout_class = OneFrameLatents
    timestep_units = "sigma"  # the transformer takes σ (the pipeline's timestep / 1000)
    flop_layout = FlopLayout(
        streams=(
            (r"time_text_embed|_mod\.|norm\w*\.linear", SAMPLE),
            (r"txt_in|add_[qkv]_proj|to_add_out|txt_mlp", "text"),
        ),
        attention=((r"transformer_blocks", "image+text", "image+text"),),
    )

    _leading_latent_args: tuple = ()
    """Arguments of the pipeline's ``prepare_latents`` before the batch size (editing: no source image, ``None``)."""

    def _scheduler_kwargs(self) -> dict:
        h, w = self.layout.latent_hw
        return linear_sigmas_with_shift(
            self.pipeline.scheduler.config, self.settings.num_inference_steps, h // 2 * w // 2
        )

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        return packed_noise(self.pipeline, self.settings, generators, self.device, self._leading_latent_args)

    def context_parallel_lengths(self) -> dict[str, int]:
        # diffusers' plan splits image and text tokens and each block's text mask (checked against one process).
        h, w = self.layout.latent_hw
        return {"image tokens": (h // 2) * (w // 2), "text tokens": self.settings.max_sequence_length}

    def context_parallel_hint(self) -> str:
        return "height/width or max_sequence_length"

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        length = self.settings.max_sequence_length
        embeds, mask = self.pipeline.encode_prompt(prompts, device=self.device, max_sequence_length=length)
        return padded_prompt(embeds, mask, length)

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        dtype = self.denoiser.dtype
        h, w = self.layout.latent_hw
        return model(
            hidden_states=latents.to(dtype),
            timestep=timestep.to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_hidden_states_mask=cond["prompt_embeds_mask"],
            img_shapes=[[(1, h // 2, w // 2), *self._source_shapes]] * latents.shape[0],
            return_dict=False,
        )[0]

    _source_shapes: tuple[tuple[int, int, int], ...] = ()
    """(frames, rows, columns) of the packed source-image grids that follow the noisy tokens (editing)."""

    def combine_guidance(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        combined = super().combine_guidance(uncond, cond, scale)
        return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class QwenImageEditPolicy(QwenImagePolicy):
    """Policy over a :class:`~diffusers.QwenImageEditPipeline` (Qwen-Image-Edit): each sample is conditioned on a
    source image (dataset column ``image``), read twice as the pipeline reads it. The VAE encodes it, resized to
    about :attr:`source_image_area` pixels at its own aspect ratio (not to the output size), and its packed latents
    follow the noisy tokens in the transformer's sequence (the velocity is read on the noisy tokens only); the text
    encoder's vision tower reads it with the instruction (the prompt embeddings include its image tokens, padded with a
    mask to ``max_sequence_length``, which must hold them: about 1,300 at 1024²). CFG's negative prompt is read with
    the same source image, so the unconditional branch is per sample.

    The source images of a run must share one size after resizing (one aspect ratio), so that samples batch.
    """

    condition_columns = ("image",)
    pipeline_tag = "image-to-image"
    _leading_latent_args = (None,)  # the sources are encoded with the conditions, not with the noise
    source_image_area: int = 1024 * 1024
    """Pixels of the source image the VAE encodes (the pipeline's fixed 1024², whatever the output size)."""
    prompt_image_area: int | None = None
    """Pixels of the source image the text encoder reads (None: the VAE's resized image, as Qwen-Image-Edit)."""
    reads_image_list = False
    """Whether the pipeline's ``encode_prompt`` takes a list of images per prompt (Edit-Plus) or one image."""

    def _images(self, image) -> list:
        """A row's source images (Qwen-Image-Edit: exactly one)."""
        if isinstance(image, (list, tuple)):
            raise ValueError(
                f"{type(self.pipeline).__name__} edits one source image per sample, got {len(image)}; "
                "QwenImageEditPlusPipeline (Qwen-Image-Edit-2509/2511) takes several"
            )
        return [image]

    def _sized(self, image, area: int):
        """``image`` resized as the pipeline resizes it: to about ``area`` pixels at its aspect ratio, sides multiples
        of 32."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        width, height = calculate_dimensions(area, image.size[0] / image.size[1])[:2]
        return self.pipeline.image_processor.resize(image, height, width), (height, width)

    @torch.no_grad()
    def _encode_prompts(self, prompts: list[str], **columns: list) -> Conditioning:
        cond = super()._encode_prompts(prompts, **columns)  # the sources' latents
        with self._text_encoders_on_device():
            texts = [
                self._read_with_images(prompt, self._images(image)) for prompt, image in zip(prompts, columns["image"])
            ]
        return cond | {key: torch.cat([text[key] for text in texts]) for key in texts[0]}

    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        return {}  # the instruction is read with its source images (encode_prompts)

    def _read_with_images(self, prompt: str, images: list) -> Conditioning:
        """One sample's prompt embeddings (and its negative's, with CFG), the text encoder reading its source images."""
        area = self.prompt_image_area or self.source_image_area
        seen = [self._sized(image, area)[0] for image in images]
        seen = seen if self.reads_image_list else seen[0]
        cond = {}
        prompts = {"": prompt} | ({"negative_": self.settings.negative_prompt or ""} if self.use_cfg else {})
        for prefix, text in prompts.items():
            embeds, mask = self.pipeline.encode_prompt(prompt=[text], image=seen, device=self.device)
            if embeds.shape[1] > self.settings.max_sequence_length:
                raise ValueError(
                    f"the prompt with its source image tokens is {embeds.shape[1]} tokens, more than max_sequence_length "
                    f"({self.settings.max_sequence_length}): raise it (the image tokens grow with the source's pixels)"
                )
            cond |= padded_prompt(embeds, mask, self.settings.max_sequence_length, prefix)
        return cond

    def _encode_columns(self, image: list) -> Conditioning:
        pipeline, latents, shapes = self.pipeline, [], None
        for row in image:
            sized = [self._sized(source, self.source_image_area) for source in self._images(row)]
            row_shapes = tuple(
                (1, h // pipeline.vae_scale_factor // 2, w // pipeline.vae_scale_factor // 2) for _, (h, w) in sized
            )
            if shapes not in (None, row_shapes) or (self._source_shapes and self._source_shapes != row_shapes):
                raise ValueError(
                    "the source images of a run must share one size after resizing (one aspect ratio per source), "
                    f"so that samples batch: got source grids {row_shapes} and {shapes or self._source_shapes}"
                )
            shapes = row_shapes
            packed = []
            for picture, (height, width) in sized:
                pixels = pipeline.image_processor.preprocess(picture, height, width).unsqueeze(2)
                encoded = pipeline._encode_vae_image(pixels.to(self.device, pipeline.vae.dtype), generator=None)
                packed.append(pipeline._pack_latents(encoded.float(), 1, encoded.shape[1], *encoded.shape[3:]))
            latents.append(torch.cat(packed, dim=1))
        self._source_shapes = shapes
        return {"image_latents": torch.cat(latents)}

    def _negative_cond(self, batch: int, cond: Conditioning) -> Conditioning:
        return {
            "prompt_embeds": cond["negative_prompt_embeds"],
            "prompt_embeds_mask": cond["negative_prompt_embeds_mask"],
        }

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        tokens = latents.shape[1]
        both = torch.cat([latents, cond["image_latents"].to(latents.dtype)], dim=1)
        return super()._forward(model, both, timestep, cond)[:, :tokens]

    def context_parallel_lengths(self) -> dict[str, int]:
        raise NotImplementedError(f"{type(self).__name__} does not support context parallelism yet")


class QwenImageEditPlusPolicy(QwenImageEditPolicy):
    """Policy over a :class:`~diffusers.QwenImageEditPlusPipeline` (Qwen-Image-Edit-2509 / 2511): as
    :class:`QwenImageEditPolicy` with one or several source images per sample (column ``image``: an image or a list),
    each encoded by the VAE at about 1024² and read by the text encoder at about 384² ("Picture 1: ..., Picture 2:
    ..."); the 2511 transformer's ``zero_cond_t`` (source tokens at timestep 0) is the transformer's own."""

    prompt_image_area = 384 * 384
    reads_image_list = True

    def _images(self, image) -> list:
        return list(image) if isinstance(image, (list, tuple)) else [image]
