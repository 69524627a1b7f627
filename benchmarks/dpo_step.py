"""Diffusion-DPO step cost: training s/pair, peak memory, overhead over the compute floor (VAE encodes, text
encodes, policy forward+backward and reference forwards on the same shapes), and the speed-up over batch size 1.

    python benchmarks/dpo_step.py                      # tiny SD1.x on the CPU, under a minute
    python benchmarks/dpo_step.py --model tiny-sd3
    python benchmarks/dpo_step.py --model flux-dev --lora-rank 64 --bf16 --batch 4   # a GPU, random weights

The last line printed is JSON with rollout_s_per_sample (null: DPO has no rollout), train_s_per_item (per pair),
peak_mem_mb, overhead_ratio, batch1_speedup.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from datasets import Dataset
from PIL import Image
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from architectures import TINY, VIDEO_MODELS, build_model, lora_config, release  # noqa: E402
from cli import add_model_arguments, emit, is_tiny, out_of_memory, resolution  # noqa: E402
from floor import CallRecorder, describe_device, peak_memory_mb, synchronize  # noqa: E402

from trl_dance import DiffusionDPOConfig, DiffusionDPOTrainer  # noqa: E402
from trl_dance.testing import tiny_preference_dataset  # noqa: E402


class _StepTimes(TrainerCallback):
    """Durations of the optimizer steps after ``warmup``; the recorder records from the end of the warm-up."""

    def __init__(self, device, warmup: int, recorder: CallRecorder | None):
        self.device, self.warmup, self.recorder = device, warmup, recorder
        self.last, self.durations = None, []

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.device)
        now = time.perf_counter()
        if state.global_step > self.warmup:
            self.durations.append(now - self.last)
        elif state.global_step == self.warmup and self.recorder:
            self.recorder.enabled = True
        self.last = now


def random_preference_dataset(count: int, size: int, seed: int = 0) -> Dataset:
    """``count`` pairs of smooth random RGB images of ``size``² pixels (what the images show does not change the
    cost of a step; decoding and resizing them does, as with real data)."""
    rng = np.random.default_rng(seed)

    def image():
        coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        return Image.fromarray(coarse).resize((size, size), Image.BICUBIC)

    prompts = [f"prompt {i}" for i in range(count)]
    return Dataset.from_dict(
        {"prompt": prompts, "chosen": [image() for _ in prompts], "rejected": [image() for _ in prompts]}
    )


def timed_run(model, args: DiffusionDPOConfig, dataset, options, warmup: int, floor: bool) -> dict:
    peft = lora_config(options.lora_rank)
    trainer = DiffusionDPOTrainer(model, args=args, train_dataset=dataset, peft_config=peft)
    device = trainer.accelerator.device
    recorder = CallRecorder(trainer) if floor else None
    steps = _StepTimes(device, warmup, recorder)
    trainer.add_callback(steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    # Median step × steps: one scheduler hiccup on a shared machine does not decide the ratio.
    wall = statistics.median(steps.durations) * len(steps.durations)
    result = {"wall_s": wall, "peak_mem_mb": peak_memory_mb(device)}
    if recorder:
        result["floor_s"] = recorder.floor_seconds()
        recorder.remove()
    release(trainer)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, default_model="tiny-sd")
    parser.add_argument("--batch", type=int, default=8, help="pairs per optimizer step")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps after a warm-up: 30 (tiny), 3")
    options = parser.parse_args(argv)
    if options.model in VIDEO_MODELS:
        parser.error(f"Diffusion-DPO trains on image pairs; {options.model} is a video model")
    options.steps = options.steps or (30 if is_tiny(options.model) else 3)
    try:
        return _benchmark(options)
    except torch.cuda.OutOfMemoryError as error:
        return out_of_memory(options, error)


def _benchmark(options) -> dict:
    size, warmup = resolution(options), 1
    count = options.batch * (options.steps + warmup)
    if is_tiny(options.model):
        dataset = tiny_preference_dataset(TINY[options.model], count=count)
    else:
        dataset = random_preference_dataset(count, size)
    with tempfile.TemporaryDirectory() as workdir:
        model = build_model(options.model, workdir, layers=options.layers)

        def config(micro_batch: int, accumulation: int):
            return DiffusionDPOConfig(
                output_dir=os.path.join(workdir, "out"),
                use_cpu=not torch.cuda.is_available(),
                bf16=options.bf16,
                report_to="none",
                save_strategy="no",
                disable_tqdm=True,
                logging_steps=10_000,
                seed=0,
                resolution=size,
                max_sequence_length=32 if is_tiny(options.model) else 512,
                beta=500.0,
                learning_rate=1e-4,
                per_device_train_batch_size=micro_batch,
                gradient_accumulation_steps=accumulation,
                activation_checkpointing=options.gradient_checkpointing,
                max_steps=warmup + options.steps,
                # the real recipes decode in 8 persistent workers; on the 2-core CPU they would take the floor's cores
                dataloader_num_workers=0 if is_tiny(options.model) else 8,
                dataloader_persistent_workers=not is_tiny(options.model),
            )

        ours = timed_run(model, config(options.batch, 1), dataset, options, warmup, floor=True)
        batch1 = None
        if not options.skip_batch1:
            batch1 = timed_run(model, config(1, options.batch), dataset, options, warmup, floor=False)

    pairs = options.batch * options.steps
    floor = sum(sum(by_name.values()) for by_name in ours["floor_s"].values())
    figures = {
        "model": options.model,
        "options": vars(options),
        "device": describe_device(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "resolution": size,
        "pairs": pairs,
        "rollout_s_per_sample": None,
        "train_s_per_item": ours["wall_s"] / pairs,
        "peak_mem_mb": ours["peak_mem_mb"],
        "overhead_ratio": ours["wall_s"] / floor,
        "floor_s": ours["floor_s"],
        "wall_s": ours["wall_s"],
        "batch1_speedup": batch1["wall_s"] / ours["wall_s"] if batch1 else None,
    }
    print(
        f"{options.model} @ {size}px: {pairs} pairs timed on {figures['device']}: "
        f"{figures['train_s_per_item'] * 1e3:.2f} ms/pair, overhead ratio {figures['overhead_ratio']:.2f}, "
        f"peak memory {figures['peak_mem_mb']:.0f} MB"
        + (f", {figures['batch1_speedup']:.2f}x faster than batch size 1" if batch1 else "")
    )
    return emit(figures)


if __name__ == "__main__":
    main()
