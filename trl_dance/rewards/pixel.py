"""Rewards computed from pixels alone: brightness (the demo's reward), DDPO's JPEG (in)compressibility, and the
temporal consistency of videos."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from .image_transforms import to_uint8


def _check(images: torch.Tensor) -> None:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape (B, 3, H, W), got {tuple(images.shape)}")


def brightness(prompts: list[str], images: torch.Tensor, **_) -> list[float]:
    """Mean pixel value of each image, in [0, 1]. A reward a randomly initialised model can always improve."""
    _check(images)
    return images.float().mean(dim=(1, 2, 3)).tolist()


def _brightness_score(prompts: list[str], images: torch.Tensor) -> torch.Tensor:
    """Differentiable brightness (B,), the graph kept (reward backpropagation)."""
    _check(images)
    return images.mean(dim=(1, 2, 3))


brightness.score = _brightness_score


def _jpeg_kb(images: torch.Tensor) -> list[float]:
    _check(images)
    sizes = []
    for array in to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    return sizes


def jpeg_compressibility(prompts: list[str], images: torch.Tensor, **_) -> list[float]:
    """DDPO's compressibility: minus the size in kB of the 8-bit image saved as JPEG at quality 95."""
    return [-size for size in _jpeg_kb(images)]


def jpeg_incompressibility(prompts: list[str], images: torch.Tensor, **_) -> list[float]:
    """DDPO's incompressibility: the size in kB of the 8-bit image saved as JPEG at quality 95."""
    return _jpeg_kb(images)


def temporal_consistency(prompts: list[str], images: torch.Tensor, **_) -> list[float]:
    """Videos (B, F, 3, H, W) in [0, 1], F >= 2: 1 − the mean absolute change of an 8-bit pixel between consecutive
    frames, over 255 (VBench's temporal-flickering score); 1 for a still video. Alone it favours static videos:
    weight it beside a content reward."""
    if images.ndim != 5 or images.shape[2] != 3 or images.shape[1] < 2:
        raise ValueError(f"temporal_consistency scores videos (B, F >= 2, 3, H, W), got {tuple(images.shape)}")
    frames = (images.detach().float().clamp(0, 1) * 255).round()
    return (1 - (frames[:, 1:] - frames[:, :-1]).abs().mean(dim=(1, 2, 3, 4)) / 255).tolist()


temporal_consistency.accepts_video = True
