"""Rows of (prompt, image or video) into training batches for supervised fine-tuning."""

from __future__ import annotations

from typing import Any

import torch

from .preference_data import INDEX_KEY, PreferenceCollator, describe_missing


class SFTCollator(PreferenceCollator):
    """Turn rows into a batch of transformed images (or video clips) with their captions: each image resized so its
    shorter side is ``resolution``, cropped (random or centred) and flipped as :class:`PreferenceCollator` does a
    pair; rows whose image is missing are skipped and counted.

    Returns a dict with ``pixel_values`` (B, 3, R, R) float32 in [-1, 1] (videos (B, F, 3, R, R)), ``prompts`` (B
    strings, "" with probability ``proportion_empty_prompts``), ``time_ids`` (B, 6) SDXL's micro-conditioning,
    ``num_missing`` and ``missing`` (each skipped row's index and path).
    """

    def __init__(self, *args, text_field: str = "prompt", image_field: str = "image", **kwargs):
        super().__init__(*args, **kwargs)
        self.text_field, self.image_field = text_field, image_field

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        pixels, prompts, time_ids, missing = [], [], [], []
        rng = self._batch_stream(rows)
        for row in rows:
            prompt = row[self.text_field]
            where = f"row {row[INDEX_KEY]}" if INDEX_KEY in row else "a row"
            try:
                media = self._load(row[self.image_field])
            except (
                ValueError
            ) as err:  # an undecodable file (truncated, not an image): skipped and counted like a missing one
                missing.append(f"{where} (prompt {prompt!r:.80}): {err}")
                continue
            if media is None:
                missing.append(f"{where}: the image {describe_missing(row[self.image_field])}")
                continue
            if self.num_frames is not None:
                if len(media) < self.num_frames:
                    raise ValueError(
                        f"SFT data, {where} (prompt {prompt!r:.80}): the video has {len(media)} frames, fewer than "
                        f"num_frames={self.num_frames} (training clips are their first num_frames frames)"
                    )
                media = media[: self.num_frames]
            (tensor,), box = self._transform([media], rng)
            pixels.append(tensor)
            prompts.append("" if rng.random() < self.proportion_empty_prompts else prompt)
            time_ids.append(box)
        if not pixels:
            raise ValueError(f"every row of the batch ({len(rows)}) has a missing image")
        return {
            "pixel_values": torch.stack(pixels),
            "prompts": prompts,
            "time_ids": torch.tensor(time_ids, dtype=torch.float32),
            "num_missing": len(missing),
            "missing": missing,
        }
