"""Pictures of a run for people: the reward curve from the Trainer's log history, and image grids."""

from __future__ import annotations

import torch
from diffusers.utils import make_image_grid
from PIL import Image

from .video import frame_strip


def save_reward_curve(log_history: list[dict], path: str, title: str = "reward") -> list[float]:
    """Plot ``reward`` (± ``reward_std``) per logged step to a PNG; returns the plotted rewards."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [entry for entry in log_history if "reward" in entry]
    if not rows:
        raise ValueError("no 'reward' entries in the log history")
    steps = [entry["step"] for entry in rows]
    mean = [entry["reward"] for entry in rows]
    std = [entry.get("reward_std", 0.0) for entry in rows]
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=100)
    axis.plot(steps, mean, marker="o", markersize=3, label="mean reward of the rollout")
    axis.fill_between(
        steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.25, label="± std"
    )
    axis.set_xlabel("optimizer step")
    axis.set_ylabel(title)
    axis.grid(alpha=0.3)
    axis.legend(loc="best", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return mean


def to_pil(images: torch.Tensor, size: int | None = None) -> list[Image.Image]:
    """(B, 3, H, W) float in [0, 1] to PIL images, optionally resized (nearest) to ``size`` pixels high; videos
    (B, F, 3, H, W) become strips of 4 evenly spaced frames (:func:`~trl_dance.video.frame_strip`)."""
    images = frame_strip(images)
    array = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    pictures = [Image.fromarray(a) for a in array]
    if size is not None:
        pictures = [p.resize((size * p.width // p.height, size), Image.NEAREST) for p in pictures]
    return pictures


def save_image_grid(rows: list[torch.Tensor], path: str, size: int | None = None) -> Image.Image:
    """Save rows of images (each (B, 3, H, W) in [0, 1], same B; videos as frame strips) as one grid PNG."""
    pictures = [p for row in rows for p in to_pil(row, size)]
    grid = make_image_grid(pictures, rows=len(rows), cols=rows[0].shape[0])
    grid.save(path)
    return grid
