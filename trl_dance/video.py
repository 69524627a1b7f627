"""Frames of videos (B, F, 3, H, W): the evenly spaced selection rewards score and trackers show."""

from __future__ import annotations

import torch


def frame_indices(num_frames: int, count: int | None) -> torch.Tensor:
    """(k,) long: ``count`` evenly spaced frame indices in ``[0, num_frames)``, first and last included; every
    frame when ``count`` is None or at least ``num_frames``."""
    if count is None or count >= num_frames:
        return torch.arange(num_frames)
    if count < 1:
        raise ValueError(f"the number of frames must be >= 1 or None, got {count}")
    return torch.linspace(0, num_frames - 1, count).round().long()


def frame_strip(media: torch.Tensor, frames: int = 4) -> torch.Tensor:
    """Videos (B, F, 3, H, W) to images (B, 3, H, k·W) of k = min(``frames``, F) evenly spaced frames side by side;
    images (B, 3, H, W) are returned as they are."""
    if media.ndim == 4:
        return media
    chosen = media[:, frame_indices(media.shape[1], frames).to(media.device)]  # (B, k, 3, H, W)
    return chosen.permute(0, 2, 3, 1, 4).flatten(3)
