"""The text-rendering task's vocabulary: words, their split into training and held-out sets, and prompts.

Prompts follow Flow-GRPO's OCR task (``a sign that says "owl"``): the target is the text between the first pair of
double quotes. Words are strings of lower-case letters (OCR rewards compare lower-cased text, and CLIP's tokenizer
lower-cases), so the task is spelling, not vocabulary: a word held out of every training prompt can only be rendered
by composing letters learned elsewhere.
"""

from __future__ import annotations

import itertools
import random
import string

PROMPT_TEMPLATE = 'a sign that says "{}"'
"""Flow-GRPO's prompt form; one template, so that a word's letters sit at the same token positions in every prompt."""

ALPHABET = string.ascii_lowercase
WORD_LENGTH = 3
NUM_HELD_OUT = 200
"""Words held out of every training prompt (of 26³ = 17,576)."""
SPLIT_SEED = 0


def prompt_for(word: str) -> str:
    """``a sign that says "word"``."""
    return PROMPT_TEMPLATE.format(word)


def word_split(length: int = WORD_LENGTH, num_held_out: int = NUM_HELD_OUT, seed: int = SPLIT_SEED):
    """``(train, held_out)``: every ``length``-letter lower-case string, shuffled with ``seed``, the first
    ``num_held_out`` held out. Deterministic across machines and Python versions (``random.Random`` of an int)."""
    words = ["".join(letters) for letters in itertools.product(ALPHABET, repeat=length)]
    random.Random(seed).shuffle(words)
    return sorted(words[num_held_out:]), sorted(words[:num_held_out])


def rl_prompts(num_train: int = 1000, seed: int = SPLIT_SEED) -> tuple[list[str], list[str]]:
    """``(train, held_out)`` prompts of the RL recipes: ``num_train`` training words (a seeded sample) and every
    held-out word, as ``recipes/data/ocr_train.txt`` and ``ocr_held_out.txt`` hold them."""
    train, held_out = word_split(seed=seed)
    return [prompt_for(w) for w in random.Random(seed + 1).sample(train, num_train)], [prompt_for(w) for w in held_out]
