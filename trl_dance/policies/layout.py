"""How a family's latents map to pixels and back: the VAE's normalisation, the packing into tokens, the frame axis.

A policy holds one (``policy.layout``), of the class its family declares (``DiffusionPolicy.layout_class``):

- :class:`SpatialLatents`: (B, C, h, w) latents (SD, SDXL, SD3, Z-Image);
- :class:`PackedLatents`: 2×2 patches packed into tokens (B, h/2 · w/2, 4C) (FLUX.1, Kontext);
- :class:`PatchifiedLatents`: FLUX.2's patchified latents normalised by the VAE's batch-norm statistics, packed;
- :class:`OneFrameLatents`: a video VAE's one-frame latents, packed (Qwen-Image; RGBA: Qwen-Image 2.1);
- :class:`VideoLatents`: (B, C, F', h, w) latents of a video VAE (Wan, HunyuanVideo); LTX-2's audio+video row is its
  own layout (:mod:`trl_dance.policies.ltx2`).

Encoding is ``pack(normalise(VAE sample(vae_input(images))))`` and decoding its inverse, ``postprocess(VAE decode(
denormalise(unpack(latents))))``; a layout overrides the parts that differ.
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers import DiffusionPipeline

from .settings import SamplerSettings


class SpatialLatents:
    """(B, C, h, w) VAE latents, normalised as the VAE's config says; images (B, 3, H, W)."""

    is_video = False

    def __init__(self, pipeline: DiffusionPipeline, settings: SamplerSettings):
        self.pipeline = pipeline
        self.settings = settings

    @classmethod
    def checked_settings(
        cls, pipeline: DiffusionPipeline, settings: SamplerSettings, default_num_frames: int | None
    ) -> SamplerSettings:
        """``settings`` as this layout needs them (video: ``num_frames`` defaulted and checked); raises on ones it
        cannot take."""
        if settings.num_frames is not None:
            raise ValueError(f"num_frames applies to video pipelines; {type(pipeline).__name__} generates images")
        return settings

    @property
    def vae_scale(self) -> int:
        """Pixels per latent along height and width."""
        pipeline = self.pipeline
        return getattr(pipeline, "vae_scale_factor", None) or getattr(pipeline, "vae_scale_factor_spatial", 8)

    def size_multiple(self) -> int:
        """What ``height`` and ``width`` must divide by: the VAE's factor times the transformer's 2×2 patches."""
        return 2 * self.vae_scale

    @property
    def latent_hw(self) -> tuple[int, int]:
        """(h, w) of the VAE latent grid at the settings' size (whole 2×2 patches)."""
        scale = self.vae_scale
        return 2 * (self.settings.height // (2 * scale)), 2 * (self.settings.width // (2 * scale))

    def vae_affine(self, like: torch.Tensor) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """``(offset, scale)`` with latents = (VAE latents − offset) · scale, broadcastable to VAE latents ``like``
        (B, C, ...): the VAE's per-channel latents_mean/std when its config has them (SDXL, Wan; Wan's VAE has no
        scaling factor), else its shift_factor and scaling_factor."""
        config = self.pipeline.vae.config
        scaling = getattr(config, "scaling_factor", None) or 1.0
        if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
            shape = (1, -1) + (1,) * (like.ndim - 2)
            mean = torch.tensor(config.latents_mean, device=like.device).view(shape)
            std = torch.tensor(config.latents_std, device=like.device).view(shape)
            return mean, scaling / std
        return getattr(config, "shift_factor", None) or 0.0, scaling

    # The parts a layout overrides.

    def vae_input(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] as the VAE reads them."""
        return images

    def normalise(self, latents: torch.Tensor) -> torch.Tensor:
        offset, scale = self.vae_affine(latents)
        return (latents - offset) * scale

    def denormalise(self, latents: torch.Tensor) -> torch.Tensor:
        offset, scale = self.vae_affine(latents)
        return latents / scale + offset

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def postprocess(self, decoded: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """The VAE's output in [-1, 1] to the pipeline's "pt" output in [0, 1] (not clamped with ``clamp=False``)."""
        if not clamp:
            return decoded / 2 + 0.5
        return self.pipeline.image_processor.postprocess(decoded, output_type="pt")

    # Encoding and decoding.

    @torch.no_grad()
    def encode(
        self,
        images: torch.Tensor,
        generator: torch.Generator | list[torch.Generator] | None,
        device: torch.device,
    ) -> torch.Tensor:
        """Images (B, 3, H, W) in [-1, 1] (videos: (B, F, 3, H, W)) to latents (B, ...) float32, the inverse of
        :meth:`decode`; the VAE posterior's sample drawn from ``generator`` (or one per image)."""
        vae = self.pipeline.vae
        pixels = self.vae_input(images).to(device=device, dtype=vae.dtype)
        return self.pack(self.normalise(vae.encode(pixels).latent_dist.sample(generator).float()))

    def decode(self, latents: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """Final latents to images: (B, 3, H, W) float32 in [0, 1] (videos: (B, F, 3, H, W))."""
        vae = self.pipeline.vae
        decoded = vae.decode(self.denormalise(self.unpack(latents)).to(vae.dtype), return_dict=False)[0]
        return self.postprocess(decoded, clamp).to(torch.promote_types(decoded.dtype, torch.float32))  # float64 stays


class PackedLatents(SpatialLatents):
    """FLUX.1's tokens (B, h/2 · w/2, 4C): 2×2 patches of the normalised VAE latents, packed as the pipeline packs."""

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipeline._pack_latents(latents, *latents.shape[:2], *latents.shape[-2:])

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        settings = self.settings
        return self.pipeline._unpack_latents(latents, settings.height, settings.width, self.pipeline.vae_scale_factor)


class PatchifiedLatents(SpatialLatents):
    """FLUX.2's tokens: the VAE latents patchified 2×2, normalised by the VAE's batch-norm statistics, packed."""

    def _batch_norm(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vae = self.pipeline.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like)
        return mean, std

    def normalise(self, latents: torch.Tensor) -> torch.Tensor:
        latents = self.pipeline._patchify_latents(latents)
        mean, std = self._batch_norm(latents)
        return (latents - mean) / std

    def denormalise(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._batch_norm(latents)
        return self.pipeline._unpatchify_latents(latents * std + mean)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipeline._pack_latents(latents)

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        # Tokens are in raster order (the latent ids'), so this is the pipeline's _unpack_latents_with_ids without
        # its id maxima, which would read the device.
        h, w = self.latent_hw
        return latents.transpose(1, 2).reshape(latents.shape[0], latents.shape[2], h // 2, w // 2)


class OneFrameLatents(PackedLatents):
    """Qwen-Image's tokens: the one-frame latents (B, C, 1, h, w) of a video VAE, packed 2×2 as in FLUX."""

    def vae_input(self, images: torch.Tensor) -> torch.Tensor:
        return images.unsqueeze(2)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        batch, channels, _, height, width = latents.shape
        return self.pipeline._pack_latents(latents, batch, channels, height, width)

    def postprocess(self, decoded: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        return super().postprocess(decoded[:, :, 0], clamp)  # the one frame of the video VAE


class RGBAOneFrameLatents(OneFrameLatents):
    """Qwen-Image 2.1's: the VAE reads and writes RGBA frames (opaque in, RGB out)."""

    def vae_input(self, images: torch.Tensor) -> torch.Tensor:
        return super().vae_input(torch.cat([images, torch.ones_like(images[:, :1])], dim=1))  # alpha 1 in [-1, 1]

    def postprocess(self, decoded: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        return super().postprocess(decoded[:, :3], clamp)


class VideoLatents(SpatialLatents):
    """(B, C, F', h, w) latents of a video VAE; videos (B, F, 3, H, W) of ``num_frames`` = 1 + a multiple of the VAE's
    temporal factor (the family's default when unset)."""

    is_video = True

    @classmethod
    def checked_settings(
        cls, pipeline: DiffusionPipeline, settings: SamplerSettings, default_num_frames: int | None
    ) -> SamplerSettings:
        if settings.num_frames is None:
            settings = dataclasses.replace(settings, num_frames=default_num_frames)
        temporal = getattr(pipeline, "vae_scale_factor_temporal", None) or pipeline.vae_temporal_compression_ratio
        if settings.num_frames < 1 or (settings.num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames must be 1 + a multiple of {temporal} for this VAE, got {settings.num_frames}"
            )
        return settings

    def vae_input(self, images: torch.Tensor) -> torch.Tensor:
        return images.transpose(1, 2)  # video VAEs take (B, 3, F, H, W)

    def postprocess(self, decoded: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        return self.pipeline.video_processor.postprocess_video(decoded, output_type="pt")


__all__ = [
    "OneFrameLatents",
    "PackedLatents",
    "PatchifiedLatents",
    "RGBAOneFrameLatents",
    "SpatialLatents",
    "VideoLatents",
]
