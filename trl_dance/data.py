"""Datasets for the recipes: prompts for GRPO, preference pairs for DPO, from local files, folders or the Hub."""

from __future__ import annotations

import os
from typing import Any

from datasets import Dataset, Image, IterableDataset, List, Value, load_dataset, load_from_disk

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_any_dataset(
    name_or_path: str, config: str | None = None, split: str = "train", streaming: bool = False
) -> Dataset | IterableDataset:
    """A map-style (memory-mapped) dataset from a data file (.json/.jsonl/.csv/.parquet), a ``save_to_disk``
    folder, or a Hub id / script folder for ``datasets.load_dataset``; with ``streaming``, an ``IterableDataset``
    read as it is consumed (nothing downloaded or converted up front)."""
    extension = os.path.splitext(name_or_path)[1].lower()
    if os.path.isfile(name_or_path):
        if extension not in _FILE_BUILDERS:
            raise ValueError(f"unsupported data file type {extension!r}: use {sorted(_FILE_BUILDERS)}")
        return load_dataset(_FILE_BUILDERS[extension], data_files=name_or_path, split="train", streaming=streaming)
    if os.path.isfile(os.path.join(name_or_path, "dataset_info.json")):
        dataset = load_from_disk(name_or_path)
        return dataset.to_iterable_dataset() if streaming else dataset
    return load_dataset(name_or_path, config, split=split, streaming=streaming)


def load_prompt_dataset(
    prompts_file: str | None = None,
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    prompt_column: str = "prompt",
) -> Dataset:
    """Load prompts for GRPO.

    Args:
        prompts_file: a local ``.txt`` file (one prompt per line, blank lines skipped) or a ``.json``/``.jsonl``/
            ``.csv``/``.parquet`` file with a ``prompt_column``.
        dataset_name: a Hub dataset id or local dataset folder (``datasets.load_dataset``), if no file is given.
        dataset_config, split: passed to ``load_dataset``.
        prompt_column: the column holding the prompts; renamed to ``prompt``.

    An ``image`` column (the conditioning image of image-to-video and editing models) holding file paths or URLs, or
    lists of them (several source images), is cast to ``datasets.Image``, so rows carry PIL images.
    """
    if (prompts_file is None) == (dataset_name is None):
        raise ValueError("give exactly one of prompts_file or dataset_name")
    if prompts_file is not None and not os.path.isfile(prompts_file):
        raise FileNotFoundError(f"prompts_file {prompts_file!r} does not exist")
    if prompts_file is not None and prompts_file.lower().endswith(".txt"):
        with open(prompts_file, encoding="utf-8") as handle:
            return Dataset.from_dict({"prompt": [line.strip() for line in handle if line.strip()]})
    dataset = load_any_dataset(prompts_file or dataset_name, dataset_config, split)
    if prompt_column not in dataset.column_names:
        raise ValueError(f"no column {prompt_column!r} in the prompts dataset; columns: {dataset.column_names}")
    if prompt_column != "prompt":
        dataset = dataset.rename_column(prompt_column, "prompt")
    if "image" in dataset.column_names:
        feature = dataset.features["image"]
        if feature == Value("string"):
            dataset = dataset.cast_column("image", Image())
        elif isinstance(feature, List) and feature.feature == Value(
            "string"
        ):  # several sources (Qwen-Image-Edit-Plus)
            dataset = dataset.cast_column("image", List(Image()))
    return dataset


def _prompt_text(value: Any, row: int) -> str:
    """A prompt as text: a string, or TRL's conversational format (a list of ``{"role", "content"}`` messages), whose
    last user turn is the prompt. Anything else raises ValueError naming the row."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        users = [m.get("content") for m in value if m["role"] == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
        raise ValueError(
            f"prompt of row {row} is a conversation without a text user turn ({value!r:.200}): an image model is "
            "prompted by the text of the last user message"
        )
    raise ValueError(
        f"prompt of row {row} must be a string (or a conversation), got {type(value).__name__}: {value!r:.100}"
    )


def text_prompts(dataset: Dataset | IterableDataset) -> Dataset | IterableDataset:
    """``dataset`` with every ``prompt`` checked to be text; TRL's conversational prompts (lists of messages) become
    the text of their last user turn. Raises ValueError naming the first bad row (for a stream: as it streams)."""
    if isinstance(dataset, IterableDataset):
        return dataset.map(
            lambda value, row: {"prompt": _prompt_text(value, row)}, input_columns="prompt", with_indices=True
        )
    prompts = dataset["prompt"]
    for row, value in enumerate(prompts):
        _prompt_text(value, row)
    if all(isinstance(value, str) for value in prompts):
        return dataset
    return dataset.map(
        lambda value, row: {"prompt": _prompt_text(value, row)}, input_columns="prompt", with_indices=True
    )
