"""Wan text-to-video and image-to-video (rectified flow, UMT5 text encoder, causal 3D VAE), CFG in sampling and
loss."""

from __future__ import annotations

import dataclasses

import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from diffusers.utils.torch_utils import randn_tensor

from .base import Conditioning, SamplerSettings
from .flow_matching import FlowMatchingPolicy


class WanPolicy(FlowMatchingPolicy):
    """Policy over a :class:`~diffusers.WanPipeline` with one transformer (Wan 2.1 T2V, Wan 2.2 TI2V-5B as T2V).

    Latents are (B, C, F', H/s, W/s) with F' = (F − 1)/t + 1 for the VAE's temporal and spatial factors t, s (4 and 8
    for Wan 2.1); :meth:`decode` returns videos (B, F, 3, H, W) in [0, 1].
    """

    is_video = True
    default_num_frames = 81
    """Wan 2.1's published frame count (5 s at 16 fps), used when ``settings.num_frames`` is None."""

    def __init__(self, pipeline: WanPipeline, settings: SamplerSettings):
        if pipeline.transformer is None or pipeline.transformer_2 is not None:
            raise ValueError(
                "two-expert Wan 2.2 pipelines (transformer_2 / boundary_ratio) are not supported: their high- and "
                "low-noise steps use different transformers; load a single-transformer pipeline"
            )
        if settings.num_frames is None:
            settings = dataclasses.replace(settings, num_frames=self.default_num_frames)
        temporal = pipeline.vae_scale_factor_temporal
        if settings.num_frames < 1 or (settings.num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames must be 1 + a multiple of {temporal} for this VAE, got {settings.num_frames}"
            )
        super().__init__(pipeline, settings)

    @torch.no_grad()
    def _encode(self, prompts: list[str], negative: bool = False) -> Conditioning:
        # The base class passes the empty prompt for the negative branch: plain encoding serves both.
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            device=self.device,
            max_sequence_length=self.settings.max_sequence_length,
        )
        return {"prompt_embeds": embeds}

    def _latent_shape(self, batch: int) -> tuple[int, ...]:
        pipeline, settings = self.pipeline, self.settings
        return (
            batch,
            pipeline.vae.config.z_dim,
            (settings.num_frames - 1) // pipeline.vae_scale_factor_temporal + 1,
            settings.height // pipeline.vae_scale_factor_spatial,
            settings.width // pipeline.vae_scale_factor_spatial,
        )

    def initial_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        # What both Wan pipelines' prepare_latents draw (the image-to-video one also encodes its image there).
        return randn_tensor(self._latent_shape(len(generators)), generator=generators, device=self.device)

    def _model_input(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The denoiser's ``hidden_states`` for the policy's latents."""
        return latents

    def _forward(self, model, latents, timestep, cond) -> torch.Tensor:
        image_embeds = cond.get("image_embeds")
        if self.pipeline.config.expand_timesteps:
            # Wan 2.2 TI2V takes one timestep per latent token (all equal in text-to-video).
            patch_t, patch_h, patch_w = self.denoiser.config.patch_size
            tokens = (latents.shape[2] // patch_t) * (latents.shape[3] // patch_h) * (latents.shape[4] // patch_w)
            timestep = timestep[:, None].expand(-1, tokens)
        dtype = self.denoiser.dtype
        # The timestep stays float32, as in WanPipeline: the transformer casts it after the sinusoidal projection.
        return model(
            hidden_states=self._model_input(latents, cond).to(dtype),
            timestep=timestep.float(),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_hidden_states_image=None if image_embeds is None else image_embeds.to(dtype),
            return_dict=False,
        )[0]

    def _postprocess(self, decoded: torch.Tensor) -> torch.Tensor:
        return self.pipeline.video_processor.postprocess_video(decoded, output_type="pt")


class WanImageToVideoPolicy(WanPolicy):
    """Policy over a :class:`~diffusers.WanImageToVideoPipeline` (Wan 2.1 I2V): each sample starts from the image in
    the dataset column ``image`` (PIL), which becomes its first frame.

    As in the pipeline, the image enters twice: its VAE latents (the image followed by black frames) with the
    first-frame mask are concatenated to the noisy latents on the channel axis, and, when the transformer has an
    image cross-attention (``image_dim``), its CLIP vision features. Both are shared by the CFG branches, which
    differ in the prompt only.
    """

    condition_columns = ("image",)

    def __init__(self, pipeline: WanImageToVideoPipeline, settings: SamplerSettings):
        if pipeline.config.expand_timesteps:
            raise ValueError(
                "Wan 2.2 TI2V image-to-video (expand_timesteps: the first frame replaces the latents) is not "
                "supported; load it as a WanPipeline for text-to-video"
            )
        super().__init__(pipeline, settings)

    @torch.no_grad()
    def _encode_columns(self, image: list) -> Conditioning:
        pipeline, settings, device = self.pipeline, self.settings, self.device
        cond = {}
        if self.denoiser.config.image_dim is not None:
            # The pipeline's encode_image, with the pixels cast to the encoder's dtype (it may be frozen in bf16).
            encoder = pipeline.image_encoder
            pixels = pipeline.image_processor(images=list(image), return_tensors="pt").pixel_values
            outputs = encoder(pixel_values=pixels.to(device, encoder.dtype), output_hidden_states=True)
            cond["image_embeds"] = outputs.hidden_states[-2]
        frames = pipeline.video_processor.preprocess(list(image), height=settings.height, width=settings.width)
        frames = frames.to(device, torch.float32)
        # One image at a time: prepare_latents repeats a single image's condition to its batch size. The given
        # (unused) latents keep it from drawing noise from the global generator.
        placeholder = torch.zeros(self._latent_shape(1), device=device)
        conditions = [
            pipeline.prepare_latents(
                frames[i : i + 1],
                1,
                pipeline.vae.config.z_dim,
                settings.height,
                settings.width,
                settings.num_frames,
                torch.float32,
                device,
                latents=placeholder,
            )[1]
            for i in range(frames.shape[0])
        ]
        cond["image_condition"] = torch.cat(conditions)  # (B, t + C, F', h, w): frame mask, image latents
        return cond

    def _model_input(self, latents: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return torch.cat([latents, cond["image_condition"].to(latents.dtype)], dim=1)
