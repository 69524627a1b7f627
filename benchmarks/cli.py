"""Command-line options and output shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import json

import torch
from architectures import DEFAULT_FRAMES, MODELS, VIDEO_MODELS


def add_model_arguments(parser: argparse.ArgumentParser, default_model: str) -> None:
    """Model, size, precision and memory options (the same in every script)."""
    parser.add_argument("--model", default=default_model, choices=sorted(MODELS))
    parser.add_argument("--resolution", type=int, default=None, help="default: 32 (tiny), 512 (real)")
    parser.add_argument("--frames", type=int, default=None, help="video models: default 5 (tiny), 33 (real)")
    parser.add_argument("--lora-rank", type=int, default=8, help="0: full fine-tune")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    parser.add_argument("--layers", type=int, default=None, help="override the real architectures' depth")
    parser.add_argument("--skip-batch1", action="store_true", help="skip the batch-size-1 comparison run")


def is_tiny(model: str) -> bool:
    return model.startswith("tiny")


def resolution(options: argparse.Namespace) -> int:
    return options.resolution or (32 if is_tiny(options.model) else 512)


def num_frames(options: argparse.Namespace) -> int | None:
    """Frames per sample of a video model (None for image models)."""
    if options.model not in VIDEO_MODELS:
        return None
    return options.frames or DEFAULT_FRAMES.get(options.model) or (5 if is_tiny(options.model) else 33)


def emit(figures: dict) -> dict:
    """The machine-readable last line of every benchmark."""
    print(json.dumps(figures))
    return figures


def out_of_memory(options: argparse.Namespace, error: torch.cuda.OutOfMemoryError) -> dict:
    """The figures of a configuration that does not fit: what it asked for, and how much memory it reached."""
    device = torch.device("cuda")
    return emit(
        {
            "model": options.model,
            "device": torch.cuda.get_device_name(device),
            "options": vars(options),
            "out_of_memory": True,
            "error": str(error).splitlines()[0],
            "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "rollout_s_per_sample": None,
            "train_s_per_item": None,
            "overhead_ratio": None,
            "batch1_speedup": None,
        }
    )
