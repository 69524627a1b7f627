"""Image conversion for the neural scorers, reproducing their torchvision/PIL preprocessing without torchvision.

Two geometries: ``"crop"`` (shortest side to ``size``, centre crop; CLIP, PickScore, ImageReward, LAION aesthetic)
and ``"pad"`` (longest side to ``size``, centre on a black square; open_clip's ``ResizeMaxSize``, HPS v2). For
square images both are a plain resize. A centre crop's offset is rounded as the scorer's own code rounds it:
``"round"`` as torchvision's ``CenterCrop`` (ImageReward's BLIP transforms), ``"floor"`` as transformers'
``CLIPImageProcessor`` (PickScore, CLIP score and the LAION aesthetic score go through it); they differ by a pixel
where the resized long side minus ``size`` is odd (832×1216, 1216×832).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_RANGE_TOLERANCE = 1e-3


def check_images(prompts: Sequence[str], images: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``images`` is (B, 3, H, W) floating point in [0, 1] with B == len(prompts)."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"{name}: images must be a tensor of shape (B, 3, H, W), got {shape}")
    if not images.is_floating_point():
        raise ValueError(f"{name}: images must be floating point in [0, 1], got {images.dtype}")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        count = "a string" if isinstance(prompts, str) else len(prompts)
        raise ValueError(f"{name}: got {count} prompts for {images.shape[0]} images; pass one prompt per image")
    low, high = (value.item() for value in torch.aminmax(images.detach()))
    if low < -_RANGE_TOLERANCE or high > 1 + _RANGE_TOLERANCE:
        raise ValueError(f"{name}: images must be in [0, 1], got values in [{low:.3f}, {high:.3f}]")


def _resized_size(height: int, width: int, size: int, mode: str) -> tuple[int, int]:
    if mode == "crop":  # torchvision Resize(int): the short side becomes `size`, the long side is truncated
        if height <= width:
            return size, int(size * width / height)
        return int(size * height / width), size
    scale = size / max(height, width)  # open_clip ResizeMaxSize
    return round(height * scale), round(width * scale)


def _place(array: np.ndarray | torch.Tensor, size: int, mode: str, offset: str = "round"):
    """Centre crop (offset rounded as ``offset`` says) or centre pad with zeros to ``size × size``; array (..., H, W)."""
    height, width = array.shape[-2:]
    if mode == "crop":
        if offset == "floor":  # transformers' center_crop
            top, left = (height - size) // 2, (width - size) // 2
        else:  # torchvision's CenterCrop
            top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
        return array[..., top : top + size, left : left + size]
    top, left = (size - height) // 2, (size - width) // 2
    padding = (left, size - width - left, top, size - height - top)
    if isinstance(array, torch.Tensor):
        return F.pad(array, padding)
    return np.pad(array, [(0, 0)] * (array.ndim - 2) + [padding[2:], padding[:2]])


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) in [0, 1] → (B, H, W, 3) uint8, rounded as diffusers' ``numpy_to_pil`` does."""
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).cpu().numpy()


def reference_pixels(
    images: torch.Tensor,
    size: int,
    mode: str = "crop",
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
    offset: str = "round",
    resample: str = "pil",
) -> torch.Tensor:
    """The scorers' own preprocessing: 8-bit RGB, bicubic resize, crop (its ``offset`` rounded ``"round"`` or
    ``"floor"``, see the module) or pad, ``/255``, normalise.

    ``resample="pil"`` resizes the 8-bit image with PIL (torchvision's ``Resize`` on a PIL image, transformers'
    processors); ``"tensor"`` divides by 255 first and resizes the float tensor, antialiased (torchvision's ``Resize``
    after ``ToTensor``: the ``hpsv2`` package's ``preprocess_val``).

    Returns:
        (B, 3, size, size) float32 on ``images.device``.
    """
    if resample == "tensor":  # the differentiable path's resize, on the 8-bit pixels
        pixels = torch.from_numpy(to_uint8(images)).permute(0, 3, 1, 2).to(images.device, torch.float32) / 255
        return tensor_pixels(pixels, size, mode, mean, std, offset)
    if resample != "pil":
        raise ValueError(f"resample must be 'pil' or 'tensor', got {resample!r}")
    out = []
    for array in to_uint8(images):
        height, width = array.shape[:2]
        new_height, new_width = _resized_size(height, width, size, mode)
        if (new_height, new_width) != (height, width):
            array = np.asarray(Image.fromarray(array).resize((new_width, new_height), Image.BICUBIC))
        out.append(_place(array.transpose(2, 0, 1), size, mode, offset))
    pixels = torch.from_numpy(np.stack(out)).to(images.device, torch.float32) / 255
    return _normalize(pixels, mean, std)


def tensor_pixels(
    images: torch.Tensor,
    size: int,
    mode: str = "crop",
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
    offset: str = "round",
) -> torch.Tensor:
    """Differentiable counterpart of :func:`reference_pixels` (antialiased bicubic, no 8-bit rounding)."""
    height, width = images.shape[-2:]
    new_size = _resized_size(height, width, size, mode)
    pixels = images.to(torch.promote_types(images.dtype, torch.float32))  # float64 stays float64
    if new_size != (height, width):
        pixels = F.interpolate(pixels, size=new_size, mode="bicubic", align_corners=False, antialias=True)
    return _normalize(_place(pixels, size, mode, offset), mean, std)


def _normalize(pixels: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    mean_t = torch.tensor(mean, device=pixels.device, dtype=pixels.dtype).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=pixels.device, dtype=pixels.dtype).view(1, 3, 1, 1)
    return (pixels - mean_t) / std_t
