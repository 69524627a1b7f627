"""Image preference pairs for Diffusion-DPO: column formats, ties, and a collator that transforms a pair jointly.

Two row formats are accepted:

* TRL's preference format: ``prompt``, ``chosen``, ``rejected`` (images as PIL images, bytes, file paths, or
  ``{"bytes": ..., "path": ...}`` dicts as stored by ``datasets.Image(decode=False)``).
* Pick-a-Pic: ``caption``, ``jpg_0``, ``jpg_1``, ``label_0`` (1: ``jpg_0`` preferred, 0: ``jpg_1`` preferred,
  0.5: tie). Rows are mapped when a batch is collated, so nothing is converted or copied up front.
"""

from __future__ import annotations

import io
import logging
import os
import random
from typing import Any

import numpy as np
import torch
from datasets import Dataset, IterableDataset
from PIL import Image

logger = logging.getLogger(__name__)

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
PICKAPIC_COLUMNS = ("caption", "jpg_0", "jpg_1", "label_0")


def preference_format(column_names: list[str]) -> str:
    """``"preference"`` or ``"pickapic"`` from a dataset's columns; a clear error for anything else."""
    if all(c in column_names for c in PREFERENCE_COLUMNS):
        return "preference"
    if all(c in column_names for c in PICKAPIC_COLUMNS):
        return "pickapic"
    raise ValueError(
        f"a preference dataset needs the columns {list(PREFERENCE_COLUMNS)} (TRL's preference format) or "
        f"{list(PICKAPIC_COLUMNS)} (Pick-a-Pic); it has {column_names}"
    )


def check_labels(dataset: Dataset) -> None:
    """Pick-a-Pic's ``label_0`` must be 1 (``jpg_0`` wins), 0 (``jpg_1`` wins) or 0.5 (a tie): ValueError naming the
    first other row."""
    for row, label in enumerate(dataset["label_0"]):
        if label not in (0, 0.5, 1):
            raise ValueError(
                f"label_0 of row {row} is {label!r}; Pick-a-Pic labels are 1 (jpg_0 wins), 0 or 0.5 (tie)"
            )


def drop_ties(dataset: Dataset | IterableDataset) -> tuple[Dataset | IterableDataset, int | None]:
    """Drop Pick-a-Pic ties (``label_0 == 0.5``) and count them. Reads only the label column; the result is an index
    mapping. A streaming dataset is filtered lazily, as it streams: the count is then ``None``."""
    kept = dataset.filter(lambda label: label != 0.5, input_columns="label_0")
    if isinstance(dataset, IterableDataset):
        return kept, None
    return kept, len(dataset) - len(kept)


def load_image(value: Any) -> Image.Image | None:
    """A PIL RGB image from a PIL image, bytes, a path or a ``{"bytes", "path"}`` dict; None if missing.

    Raises:
        ValueError naming the file (or the bytes' length) when the image cannot be decoded (truncated, not an image).
    """
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
        if value is None:
            return None
    source = f"{len(value)} bytes" if isinstance(value, (bytes, bytearray)) else repr(value)
    try:
        if isinstance(value, (bytes, bytearray)):
            value = Image.open(io.BytesIO(value))
        elif isinstance(value, str):
            if not os.path.isfile(value):
                return None
            value = Image.open(value)
        if not isinstance(value, Image.Image):
            raise TypeError(f"cannot read an image from {type(value).__name__}")
        return value.convert("RGB")  # decodes the pixels: a truncated file fails here
    except (OSError, SyntaxError) as err:  # PIL's errors for truncated and unidentified images
        raise ValueError(f"cannot decode the image {source}: {err}") from err


INDEX_KEY = "__row_index__"


class IndexedRows(torch.utils.data.Dataset):
    """A map-style ``datasets.Dataset`` whose rows carry their index (``INDEX_KEY``), for :class:`PreferenceCollator`
    to seed each batch's crops, flips and prompt drops by the rows it holds."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[index], INDEX_KEY: index}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [{**row, INDEX_KEY: i} for i, row in zip(indices, self.dataset.__getitems__(indices))]


def pair_from_row(row: dict[str, Any]) -> tuple[str, Any, Any, float]:
    """``(prompt, chosen, rejected, weight)`` of a row in either format; weight 0.5 for a (kept) tie."""
    if "jpg_0" in row:
        label = float(row["label_0"])
        chosen, rejected = (row["jpg_0"], row["jpg_1"]) if label >= 0.5 else (row["jpg_1"], row["jpg_0"])
        return row["caption"], chosen, rejected, 0.5 if label == 0.5 else 1.0
    return row["prompt"], row["chosen"], row["rejected"], 1.0


class PreferenceCollator:
    """Turn rows into a batch of jointly transformed pairs.

    Both images of a pair are resized so the shorter side is ``resolution``, then cropped at the same place
    (random or centred) and flipped together. Rows with a missing image are skipped and counted.

    Returns a dict with ``pixel_values`` (B, 2, 3, R, R) float32 in [-1, 1] (chosen first), ``prompts`` (B strings,
    "" with probability ``proportion_empty_prompts``), ``weights`` (B,) (0.5 for ties), ``time_ids`` (B, 6) the SDXL
    micro-conditioning (original H, W of the chosen image, crop top, left, R, R), and ``num_missing``.

    ``seed`` should differ between processes. Rows from :class:`IndexedRows` (the trainer's map-style data) seed each
    batch by ``seed`` and the batch's row indices, so a resumed run draws what the uninterrupted one drew. Other rows
    (streams): each ``DataLoader`` worker draws from its own stream, derived from the
    seed and the worker's torch seed (new every epoch), so workers do not repeat each other's crops, flips and
    prompt drops.
    """

    def __init__(
        self,
        resolution: int,
        random_crop: bool = False,
        random_flip: bool = True,
        proportion_empty_prompts: float = 0.0,
        seed: int = 0,
    ):
        self.resolution = resolution
        self.random_crop = random_crop
        self.random_flip = random_flip
        self.proportion_empty_prompts = proportion_empty_prompts
        self.seed = seed
        self.rng = random.Random(seed)
        self._worker_seed = None  # the torch seed of the DataLoader worker self.rng belongs to; None: main process

    def _stream(self) -> random.Random:
        worker = torch.utils.data.get_worker_info()
        worker_seed = None if worker is None else worker.seed
        if worker_seed != self._worker_seed:
            self._worker_seed, self.rng = worker_seed, random.Random(f"{self.seed}/{worker_seed}")
        return self.rng

    def _resize(self, image: Image.Image, size: tuple[int, int] | None = None) -> Image.Image:
        if size is None:
            scale = self.resolution / min(image.size)
            size = (
                max(self.resolution, round(image.width * scale)),
                max(self.resolution, round(image.height * scale)),
            )
        return image.resize(size, Image.BILINEAR)

    def _to_tensor(self, image: Image.Image) -> torch.Tensor:
        array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
        return torch.from_numpy(array).permute(2, 0, 1)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        pixels, prompts, weights, time_ids, missing = [], [], [], [], 0
        r, rng = self.resolution, self._stream()
        if rows and all(INDEX_KEY in row for row in rows):
            # Rows from IndexedRows: the batch's draws are a function of its rows, the same whichever worker
            # collates it and whether earlier batches were skipped (a resumed run).
            rng = random.Random(f"{self.seed}/{[row[INDEX_KEY] for row in rows]}")
        for row in rows:
            prompt, chosen, rejected, weight = pair_from_row(row)
            try:
                chosen, rejected = load_image(chosen), load_image(rejected)
            except ValueError as err:
                where = f"row {row[INDEX_KEY]}" if INDEX_KEY in row else "a row"
                raise ValueError(f"preference data, {where} (prompt {prompt!r:.80}): {err}") from err
            if chosen is None or rejected is None:
                missing += 1
                continue
            original = (chosen.height, chosen.width)
            chosen = self._resize(chosen)
            rejected = self._resize(rejected, chosen.size)  # same size, so the same crop box fits both
            if self.random_crop:
                top, left = rng.randint(0, chosen.height - r), rng.randint(0, chosen.width - r)
            else:
                top, left = (chosen.height - r) // 2, (chosen.width - r) // 2
            flip = self.random_flip and rng.random() < 0.5
            pair = []
            for image in (chosen, rejected):
                image = image.crop((left, top, left + r, top + r))
                if flip:
                    image = image.transpose(Image.FLIP_LEFT_RIGHT)
                pair.append(self._to_tensor(image))
            pixels.append(torch.stack(pair))
            prompts.append("" if rng.random() < self.proportion_empty_prompts else prompt)
            weights.append(weight)
            time_ids.append([*original, top, left, r, r])
        if not pixels:
            raise ValueError(f"every row of the batch ({len(rows)}) has a missing image")
        return {
            "pixel_values": torch.stack(pixels),
            "prompts": prompts,
            "weights": torch.tensor(weights, dtype=torch.float32),
            "time_ids": torch.tensor(time_ids, dtype=torch.float32),
            "num_missing": missing,
        }
