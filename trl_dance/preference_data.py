"""Image and video preference pairs for Diffusion-DPO: column formats, ties, and a collator that transforms a pair
jointly.

Two row formats are accepted:

* TRL's preference format: ``prompt``, ``chosen``, ``rejected`` (images as PIL images, bytes, file paths, or
  ``{"bytes": ..., "path": ...}`` dicts as stored by ``datasets.Image(decode=False)``; videos as lists of such frames
  or paths of video files: GIF, or MP4 and the like with ``imageio`` and ``imageio-ffmpeg`` installed).
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


def describe_missing(value: Any) -> str:
    """How a missing image or video was given, for a warning: its path, or that the row has none."""
    if isinstance(value, dict):
        value = value.get("path") or value.get("bytes")
    if isinstance(value, str):
        return f"{value!r} (no such file; relative paths resolve from {os.getcwd()!r})"
    return "(none given: no path or bytes)"


def load_video(value: Any) -> list[Image.Image] | None:
    """A video as its PIL RGB frames, from a list of frames (anything :func:`load_image` reads) or a video file's
    path (read by ``diffusers.utils.load_video``); None if it, or any of its frames, is missing."""
    if value is None:
        return None
    if isinstance(value, str):
        if not os.path.isfile(value):
            return None
        from diffusers.utils import load_video as read_video

        try:
            return [frame.convert("RGB") for frame in read_video(value)]
        except (OSError, ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"cannot read the video {value!r}: {err}") from err
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"a video is a list of frames or a video file's path, got {type(value).__name__}")
    frames = [load_image(frame) for frame in value]
    return None if not frames or any(frame is None for frame in frames) else frames


def to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image as (3, H, W) float32 in [-1, 1]."""
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)


def fitted_media(values: list[Any], height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
    """Images as (B, 3, H, W) float32 in [-1, 1], or with ``num_frames`` videos as (B, F, 3, H, W) of their first F
    frames: each resized (bilinear) to cover ``height`` × ``width``, then centre-cropped (diffusers'
    ``VaeImageProcessor.preprocess(resize_mode="crop")``). ValueError naming the first value that is missing or too
    short."""
    from diffusers.image_processor import VaeImageProcessor

    # vae_scale_factor 1: its default, 8, would round height and width down to multiples of 8
    processor = VaeImageProcessor(vae_scale_factor=1, resample="bilinear", do_convert_rgb=True)
    batch = []
    for i, value in enumerate(values):
        if num_frames is None:
            frames = None if (image := load_image(value)) is None else [image]
        else:
            frames = load_video(value)
        if frames is None:
            raise ValueError(f"value {i}: the {'video' if num_frames else 'image'} {describe_missing(value)}")
        if num_frames is not None and len(frames) < num_frames:
            raise ValueError(f"value {i}: the video has {len(frames)} frames, fewer than num_frames={num_frames}")
        fitted = processor.preprocess(frames[: num_frames or 1], height, width, resize_mode="crop")
        batch.append(fitted if num_frames is not None else fitted[0])
    return torch.stack(batch)


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

    With ``num_frames`` the rows hold videos (see :func:`load_video`): both are cut to their first ``num_frames``
    frames (a video with fewer is an error naming the row), and every frame of the pair gets the same resize, crop
    and flip.

    Returns a dict with ``pixel_values`` (B, 2, 3, R, R) float32 in [-1, 1] (chosen first; videos (B, 2, F, 3, R, R)),
    ``prompts`` (B strings,
    "" with probability ``proportion_empty_prompts``), ``weights`` (B,) (0.5 for ties), ``time_ids`` (B, 6) the SDXL
    micro-conditioning (original H, W of the chosen image, crop top, left, R, R), ``num_missing`` and ``missing`` (a
    description of each skipped row: its index, which image, its path).

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
        num_frames: int | None = None,
    ):
        self.resolution = resolution
        self.num_frames = num_frames
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

    def _size(self, image: Image.Image) -> tuple[int, int]:
        """(width, height) with the shorter side at ``resolution``."""
        scale = self.resolution / min(image.size)
        return max(self.resolution, round(image.width * scale)), max(self.resolution, round(image.height * scale))

    def _load(self, value: Any) -> list[Image.Image] | None:
        """The frames of a video (with ``num_frames``) or the one image of a row's value; None if missing."""
        if self.num_frames is not None:
            return load_video(value)
        image = load_image(value)
        return None if image is None else [image]

    def _transform(self, media: list[list[Image.Image]], rng: random.Random) -> tuple[list[torch.Tensor], list[int]]:
        """The frames of each of ``media`` resized (shorter side ``resolution``), cropped at one place and flipped
        together, as (3, R, R) tensors (an image) or (F, 3, R, R) (with ``num_frames``); and SDXL's micro-conditioning
        of the first: its original height and width, the crop's top and left, R, R."""
        r, first = self.resolution, media[0][0]
        size = self._size(first)  # every frame to this size, so one crop box fits all
        if self.random_crop:
            top, left = rng.randint(0, size[1] - r), rng.randint(0, size[0] - r)
        else:
            top, left = (size[1] - r) // 2, (size[0] - r) // 2
        flip = self.random_flip and rng.random() < 0.5
        tensors = []
        for frames in media:
            frame_tensors = []
            for image in frames:
                image = image.resize(size, Image.BILINEAR).crop((left, top, left + r, top + r))
                if flip:
                    image = image.transpose(Image.FLIP_LEFT_RIGHT)
                frame_tensors.append(to_tensor(image))
            tensors.append(torch.stack(frame_tensors) if self.num_frames is not None else frame_tensors[0])
        return tensors, [first.height, first.width, top, left, r, r]

    def _batch_stream(self, rows: list[dict[str, Any]]) -> random.Random:
        """The random stream of a batch: from its rows' indices when they come from :class:`IndexedRows` (the same
        whichever worker collates it and whether earlier batches were skipped: a resumed run), else the worker's."""
        if rows and all(INDEX_KEY in row for row in rows):
            return random.Random(f"{self.seed}/{[row[INDEX_KEY] for row in rows]}")
        return self._stream()

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        pixels, prompts, weights, time_ids, missing = [], [], [], [], []
        rng = self._batch_stream(rows)
        for row in rows:
            prompt, chosen_value, rejected_value, weight = pair_from_row(row)
            where = f"row {row[INDEX_KEY]}" if INDEX_KEY in row else "a row"
            try:
                chosen, rejected = self._load(chosen_value), self._load(rejected_value)
            except (
                ValueError
            ) as err:  # an undecodable file (truncated, not an image): skipped and counted like a missing one
                missing.append(f"{where} (prompt {prompt!r:.80}): {err}")
                continue
            if chosen is None or rejected is None:
                side, value = ("chosen", chosen_value) if chosen is None else ("rejected", rejected_value)
                missing.append(f"{where}: the {side} image {describe_missing(value)}")
                continue
            if self.num_frames is not None:
                if len(chosen) != len(rejected) or len(chosen) < self.num_frames:
                    raise ValueError(
                        f"preference data, {where} (prompt {prompt!r:.80}): the chosen video has {len(chosen)} frames "
                        f"and the rejected {len(rejected)}; a pair's videos must have the same length, at least "
                        f"num_frames={self.num_frames} (training clips are their first num_frames frames)"
                    )
                chosen, rejected = chosen[: self.num_frames], rejected[: self.num_frames]
            pair, box = self._transform([chosen, rejected], rng)
            pixels.append(torch.stack(pair))
            prompts.append("" if rng.random() < self.proportion_empty_prompts else prompt)
            weights.append(weight)
            time_ids.append(box)
        if not pixels:
            raise ValueError(f"every row of the batch ({len(rows)}) has a missing image")
        return {
            "pixel_values": torch.stack(pixels),
            "prompts": prompts,
            "weights": torch.tensor(weights, dtype=torch.float32),
            "time_ids": torch.tensor(time_ids, dtype=torch.float32),
            "num_missing": len(missing),
            "missing": missing,
        }
