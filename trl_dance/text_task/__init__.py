"""The text-rendering task: a small SD3 pipeline really trained to render words, prompts in Flow-GRPO's OCR form,
training and held-out words, and its judges (two OCR engines, exact match, character IoU, within-prompt
diversity).

    python -m trl_dance.text_task build DIR        # rebuild the shipped model from scratch (seeded)
    python -m trl_dance.text_task evaluate MODEL   # held-out accuracy of both OCR engines
"""

from .render import FONTS, IMAGE_SIZE, render_word
from .words import PROMPT_TEMPLATE, prompt_for, word_split

__all__ = ["FONTS", "IMAGE_SIZE", "PROMPT_TEMPLATE", "prompt_for", "render_word", "word_split"]
