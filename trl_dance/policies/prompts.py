"""Prompt checks shared by every family."""

from __future__ import annotations

import logging

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


__all__ = ["warn_long_prompts"]
