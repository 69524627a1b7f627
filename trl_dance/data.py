"""Prompt datasets for the GRPO trainers: a local file or a Hub dataset, as a ``datasets.Dataset`` with ``prompt``."""

from __future__ import annotations

import os

from datasets import Dataset, load_dataset


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
    """
    if (prompts_file is None) == (dataset_name is None):
        raise ValueError("give exactly one of prompts_file or dataset_name")
    if prompts_file is not None:
        if not os.path.isfile(prompts_file):
            raise FileNotFoundError(f"prompts_file {prompts_file!r} does not exist")
        extension = os.path.splitext(prompts_file)[1].lower()
        if extension == ".txt":
            with open(prompts_file, encoding="utf-8") as handle:
                prompts = [line.strip() for line in handle if line.strip()]
            return Dataset.from_dict({"prompt": prompts})
        builder = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}.get(extension)
        if builder is None:
            raise ValueError(f"unsupported prompts_file type {extension!r}: use .txt, .json, .jsonl, .csv or .parquet")
        dataset = load_dataset(builder, data_files=prompts_file, split="train")
    else:
        dataset = load_dataset(dataset_name, dataset_config, split=split)
    if prompt_column not in dataset.column_names:
        raise ValueError(f"no column {prompt_column!r} in the prompts dataset; columns: {dataset.column_names}")
    if prompt_column != "prompt":
        dataset = dataset.rename_column(prompt_column, "prompt")
    return dataset
