"""How the text task is judged: held-out words sampled with fixed seeds, read by both OCR engines, and how varied a
prompt's samples stay (reward hacking narrows them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..rewards.ocr import ENGINES, METRICS, read_text
from .words import prompt_for


def within_prompt_diversity(images: torch.Tensor) -> float:
    """Mean over prompts of the mean pairwise RMS pixel difference between a prompt's samples.

    Args:
        images: (P, G, 3, H, W) in [0, 1], G >= 2 samples (different seeds) of each of P prompts.
    Returns:
        a float in [0, 1]: 0 when every prompt always yields the same image (a collapsed policy).
    """
    if images.ndim != 5 or images.shape[1] < 2:
        raise ValueError(f"images must be (prompts, G >= 2, 3, H, W), got {tuple(images.shape)}")
    flat = images.float().flatten(2)  # (P, G, D)
    distances = torch.cdist(flat, flat) / flat.shape[-1] ** 0.5  # (P, G, G) RMS differences
    g = flat.shape[1]
    return (distances.sum(dim=(1, 2)) / (g * (g - 1))).mean().item()


def judge_images(images: torch.Tensor, targets: Sequence[str], engines: Sequence[str] = ENGINES) -> dict[str, float]:
    """``{"<engine>/<metric>": mean}`` for each engine of ``engines`` and each metric of
    :data:`~trl_dance.rewards.ocr.METRICS` (edit, exact, char_iou), reading each image once per engine.

    Args:
        images: (N, 3, H, W) in [0, 1]; targets: N strings.
    """
    scores = {}
    for engine in engines:
        readings = read_text(images, engine)
        for name, metric in METRICS.items():
            scores[f"{engine}/{name}"] = sum(map(metric, readings, targets)) / len(targets)
    return scores


def sample_words(generate: Callable[[list[str], list[int]], torch.Tensor], words: Sequence[str],
                 samples_per_word: int = 1, seed: int = 0, batch_size: int = 64) -> torch.Tensor:  # fmt: skip
    """(len(words), samples_per_word, 3, H, W) images of ``generate(prompts, seeds)``, sample ``j`` of word ``i``
    drawn with seed ``seed + i * samples_per_word + j``: the same starts at every evaluation and for every model,
    and a start of its own for every sample (one start for all words would judge every word in one style)."""
    rows = [(prompt_for(word), seed + i * samples_per_word + j) for i, word in enumerate(words)
            for j in range(samples_per_word)]  # fmt: skip
    images = torch.cat([generate(*map(list, zip(*rows[i : i + batch_size]))) for i in range(0, len(rows), batch_size)])
    return images.view(len(words), samples_per_word, *images.shape[1:])


def pipeline_generator(pipeline, **sampling) -> Callable[[list[str], list[int]], torch.Tensor]:
    """``generate(prompts, seeds)`` with a diffusers pipeline's own sampler (its ``__call__``), one CPU generator per
    sample; ``sampling``: its call's arguments (steps, guidance scale, size)."""

    def generate(prompts: list[str], seeds: list[int]) -> torch.Tensor:
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        with torch.no_grad():
            return pipeline(prompts, generator=generators, output_type="pt", **sampling).images.float().cpu()

    return generate
