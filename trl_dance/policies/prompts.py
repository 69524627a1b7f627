"""Prompt checks and text-padding helpers shared by every family."""

from __future__ import annotations

import logging

import torch
from diffusers import DiffusionPipeline

logger = logging.getLogger(__name__)


def warn_long_prompts(pipeline: DiffusionPipeline, prompts: list[str], max_sequence_length: int) -> bool:
    """Warn if prompts are longer than one of the pipeline's text encoders reads (CLIP: 77 tokens; T5 and the
    others: ``max_sequence_length``): the pipeline truncates them. Returns whether it warned (policies warn once)."""
    for name, tokenizer in pipeline.components.items():
        # ByT5 (HunyuanVideo 1.5's glyph encoder) reads only a prompt's quoted text, at its own fixed length.
        if not name.startswith("tokenizer") or tokenizer is None or type(tokenizer).__name__ == "ByT5Tokenizer":
            continue
        clip = "CLIP" in type(tokenizer).__name__
        limit = tokenizer.model_max_length if clip else max_sequence_length
        lengths = [len(ids) for ids in tokenizer(prompts, truncation=False)["input_ids"]]
        over = [(length, prompt) for length, prompt in zip(lengths, prompts) if length > limit]
        if over:
            length, prompt = max(over)
            logger.warning(
                f"{len(over)} of {len(prompts)} prompts are longer than the {limit} tokens {name} "
                f"({type(tokenizer).__name__}) reads and are truncated, e.g. {prompt[:80]!r}... ({length} tokens)"
                + ("" if clip else "; raise max_sequence_length to keep more")
                + ". Warned once."
            )
            return True
    return False


TEXT_LENGTH_MULTIPLE = 8
"""Trimmed text lengths are rounded up to a multiple of this many tokens: aligned GEMM shapes (16-byte rows of bf16),
and a few distinct lengths per run for ``torch.compile``."""


def trim_padded_text(cond: dict[str, torch.Tensor], pairs: dict[str, str], multiple: int) -> dict[str, torch.Tensor]:
    """``cond`` with each embeddings entry of ``pairs`` (key → its (B, L) mask's key) and its mask cut to the columns
    up to the batch's last valid token, rounded up to ``multiple`` (at most L): (B, L', ...) with L' ≤ L. Columns where
    any prompt of the batch has a valid token are kept, so padding on either side is safe (left padding keeps L).
    Reads the masks on the host."""
    trimmed = dict(cond)
    for key, mask_key in pairs.items():
        if key not in cond:
            continue
        mask = cond[mask_key]
        valid = torch.nonzero(mask.bool().any(dim=0))
        length = int(valid.max()) + 1 if len(valid) else 0
        length = min(-(-length // multiple) * multiple, mask.shape[1])
        # (copies: the padding's memory is freed, and the denoiser reads contiguous rows)
        trimmed[key], trimmed[mask_key] = cond[key][:, :length].contiguous(), mask[:, :length].contiguous()
    return trimmed


def cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along the batch of text embeddings (B_i, L_i, ...) or masks (B_i, L_i) trimmed to different
    lengths, each zero-padded to the longest (a mask's zeros: padding)."""
    length = max(tensor.shape[1] for tensor in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, length - t.shape[1])) for t in tensors])


__all__ = ["TEXT_LENGTH_MULTIPLE", "cat_padded", "trim_padded_text", "warn_long_prompts"]
