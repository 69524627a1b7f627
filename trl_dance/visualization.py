"""Pictures of a run for people: the reward curve from the Trainer's log history, and image grids."""

from __future__ import annotations

import torch
from PIL import Image

from .video import frame_strip


def save_reward_curve(log_history: list[dict], path: str, title: str = "reward", key: str = "reward") -> list[float]:
    """Plot the logged ``key`` (± ``<key>_std`` when logged) per step to a PNG; returns the plotted values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [entry for entry in log_history if key in entry]
    if not rows:
        raise ValueError(f"no {key!r} entries in the log history")
    steps = [entry["step"] for entry in rows]
    mean = [entry[key] for entry in rows]
    std = [entry.get(f"{key}_std", 0.0) for entry in rows]
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=100)
    axis.plot(steps, mean, marker="o", markersize=3, label="mean reward of the rollout" if key == "reward" else key)
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


GAP = 6  # pixels between pictures, so neighbouring videos' frame strips do not run into each other
LABEL_WIDTH = 56  # the row labels' column
CAPTION_HEIGHT = 30  # the captions' row (two lines of the default font)


def save_image_grid(
    rows: list[torch.Tensor],
    path: str,
    size: int | None = None,
    row_labels: list[str] | None = None,
    captions: list[str] | None = None,
) -> Image.Image:
    """Save rows of images (each (B, 3, H, W) in [0, 1], same B; videos as frame strips) as one PNG on white, with
    ``GAP`` pixels between pictures, ``row_labels`` (e.g. before / after) on the left and ``captions`` (e.g. the B
    prompts) under the columns, each when given."""
    from PIL import ImageDraw

    pictures = [to_pil(row, size) for row in rows]
    width, height = pictures[0][0].size
    left = LABEL_WIDTH if row_labels else 0
    bottom = CAPTION_HEIGHT if captions else 0
    columns = len(pictures[0])
    grid = Image.new(
        "RGB",
        (left + columns * width + (columns - 1) * GAP, len(rows) * height + (len(rows) - 1) * GAP + bottom),
        "white",
    )
    draw = ImageDraw.Draw(grid)
    for r, row in enumerate(pictures):
        top = r * (height + GAP)
        for c, picture in enumerate(row):
            grid.paste(picture, (left + c * (width + GAP), top))
        if row_labels:
            draw.text((4, top + height // 2 - 6), row_labels[r], fill="black")
    font = _caption_font()
    for c, caption in enumerate(captions or []):
        lines = _wrap(caption, lambda text: draw.textlength(text, font=font), width, lines=2)
        draw.text((left + c * (width + GAP), grid.height - bottom + 2), "\n".join(lines), fill="black", font=font)
    grid.save(path)
    return grid


def _caption_font():
    """DejaVu Sans at 10 px (matplotlib's; Pillow's default font draws a space 2 px wide, and captions read as one
    word)."""
    from matplotlib import font_manager
    from PIL import ImageFont

    return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), 10)


def _wrap(text: str, measure, width: float, lines: int) -> list[str]:
    """At most ``lines`` lines of ``text`` broken between words, each at most ``width`` wide by ``measure``; a word
    wider than a line is cut, and text past the last line ends in "…"."""
    out, words = [], text.split()
    while words and len(out) < lines:
        line, cut = words.pop(0), None
        while measure(line[:cut]) > width and len(line[:cut]) > 1:  # a word wider than a line: cut, the rest next
            cut = len(line[:cut]) - 1
        if cut is not None:
            words.insert(0, line[cut:])
            line = line[:cut]
        while words and measure(f"{line} {words[0]}") <= width:
            line = f"{line} {words.pop(0)}"
        out.append(line)
    if words and out:
        while out[-1] and measure(out[-1] + "…") > width:
            out[-1] = out[-1][:-1]
        out[-1] += "…"
    return out
