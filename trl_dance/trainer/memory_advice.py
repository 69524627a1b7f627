"""An out-of-memory error turned into what to change: the phase it happened in, the sizes that set its memory and
the config fields that lower it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_NAMED = "_trl_dance_phase"  # set on the error raised here, so an enclosing phase passes it on unchanged


def _sizes(args) -> str:
    """The sizes that set a step's memory, as the config states them."""
    parts = []
    height, width = getattr(args, "height", None), getattr(args, "width", None)
    if height and width:
        parts.append(f"{height}×{width}")
    elif getattr(args, "resolution", None):
        parts.append(f"{args.resolution}²")
    if getattr(args, "num_frames", None):
        parts.append(f"{args.num_frames} frames")
    if hasattr(args, "per_device_generation_batch_size"):
        chunk = args.rollout_batch_size or args.per_device_generation_batch_size
        parts.append(
            f"{args.per_device_generation_batch_size} samples per process per round, rolled out {chunk} at once"
        )
    parts.append(f"{args.per_device_train_batch_size} per training micro-batch")
    if getattr(args, "guidance_scale", 1.0) > 1:
        parts.append(f"CFG {args.guidance_scale:g} (both branches in one batch)")
    parts.append(f"activation_checkpointing {args.activation_checkpointing}")
    parts.append(f"context_parallel_size {args.context_parallel_size}")
    return ", ".join(parts)


def _advice(args, phase: str) -> str:
    """The fields that lower the memory of ``phase``."""
    if phase == "rollout":
        fields = ["rollout_batch_size (fewer samples denoised at once)", "offload_text_encoders", "frozen_dtype"]
        if getattr(args, "rollout_backprop", False):
            fields.insert(
                0, "rollout_backprop=False or a lower timestep_fraction (its graphs are held until the rewards)"
            )
    elif phase == "reward":
        fields = ["the reward's batch size (reward_kwargs)", "rollout_batch_size (each chunk is scored at once)"]
        if getattr(args, "num_frames", None):
            fields.append("video_reward_frames")
    else:
        fields = [
            "per_device_train_batch_size (raise gradient_accumulation_steps to keep the update)",
            "activation_checkpointing",
        ]
    if args.context_parallel_size == 1 and getattr(args, "num_frames", None):
        fields.append("context_parallel_size (split each video's sequence over GPUs)")
    return "; ".join(fields)


@contextlib.contextmanager
def named_out_of_memory(phase: str, args) -> Iterator[None]:
    """Re-raise an out-of-memory error inside with the ``phase`` (rollout, reward, training), the config's sizes and
    what lowers them; the accelerator's own message follows."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        if getattr(error, _NAMED, None):
            raise
        named = torch.OutOfMemoryError(
            f"out of accelerator memory in the {phase} ({_sizes(args)}). To lower it: {_advice(args, phase)}.\n{error}"
        )
        setattr(named, _NAMED, phase)
        raise named from error


__all__ = ["named_out_of_memory"]
