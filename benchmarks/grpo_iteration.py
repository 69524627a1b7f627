"""DanceGRPO iteration cost: rollout s/sample, training s/transition, peak memory, overhead over the compute floor,
and the speed-up over batch-size-1 rollouts and training (how the DanceGRPO reference runs), all in one run.

    python benchmarks/grpo_iteration.py                       # tiny FLUX on the CPU, under a minute
    python benchmarks/grpo_iteration.py --model flux-dev --resolution 512 --lora-rank 64   # a GPU, random weights

The last line printed is JSON with rollout_s_per_sample, train_s_per_item, peak_mem_mb, overhead_ratio,
batch1_speedup (and the figures they come from). See benchmarks/floor.py for what the floor contains.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from datasets import Dataset
from torch._dynamo.utils import counters
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from architectures import (  # noqa: E402
    CONFIG_OVERRIDES,
    IMAGE_CONDITIONED_MODELS,
    LAST_FRAME_MODELS,
    PIPELINE_KWARGS,
    build_model,
    lora_config,
    release,
)
from cli import add_model_arguments, emit, is_tiny, num_frames, out_of_memory, resolution  # noqa: E402
from floor import CallRecorder, describe_device, peak_memory_mb, peak_tflops, synchronize  # noqa: E402
from kernel_profile import RoundProfiler, phase, summary_line  # noqa: E402

from trl_dance import DanceGRPOConfig, DanceGRPOTrainer  # noqa: E402
from trl_dance.testing import tiny_condition_images  # noqa: E402

_START = time.perf_counter()


def progress(message: str) -> None:
    """A timestamped line on stderr: a run stopped by matrix.py's timeout still says where its time went."""
    print(f"progress {time.perf_counter() - _START:7.1f} s: {message}", file=sys.stderr, flush=True)


PROMPTS = ["a cat", "a dog", "a red house", "blue sky", "green tree", "old car", "big ship", "sun set"]
# Real sizes: prompts as long in tokens as RL prompt sets' (40-60 tokens), since the masked-text families trim their
# text to a batch's longest prompt. Random-weight pipelines read prompts with the tiny offline tokenizers, about one
# token per character: these are 40-48 of them.
LONG_PROMPTS = [
    "a ginger cat asleep on a sunlit windowsill, film photo",
    "a golden retriever running through waves at sunset",
    "a small red house on a rocky island in a grey sea",
    "a blue sky over a field of sunflowers, bees, midday",
    "an old oak tree alone on a green hill, stormy sky",
    "a vintage turquoise car on a cobbled street, sunny",
    "a wooden sailing ship on a rough ocean at dawn, oil",
    "a sunset over a mountain lake, a canoe, pine trees",
]


class _StepClock(TrainerCallback):
    """Time of each optimizer step's end (one update per round in this benchmark), and the FLOPs the trainer counted
    in each round's training phase."""

    def __init__(self, device, trainer):
        self.device, self.trainer, self.ends, self.rollout_flops, self.train_flops = device, trainer, [], [], []
        self.train_range = None  # the profiler's "train" range of a profiled round, closed here
        self.graphs = []  # dynamo's compiled graphs so far, at each round's end

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.ends.append(time.perf_counter())
        if self.train_range is not None:
            self.train_range.__exit__(None, None, None)
            self.train_range = None
        # The trainer's closed-form count of the round by phase (a differentiable rollout call's backward counts with
        # its call, in the rollout: rollout_backprop's training phase has none).
        by_phase = self.trainer.flops.take_by_phase()
        self.rollout_flops.append(by_phase.pop("rollout", 0.0))
        self.train_flops.append(sum(by_phase.values()))
        self.graphs.append(counters["stats"]["unique_graphs"])


def timed_run(model: str, args: DanceGRPOConfig, options, warmup: int, floor: bool) -> dict:
    """Train ``args.max_steps`` rounds (one update each); time the rounds after ``warmup`` (rollout and training
    apart) and, with ``floor``, their compute floor."""
    peft = lora_config(options.lora_rank)
    rows = {"prompt": PROMPTS if is_tiny(options.model) else LONG_PROMPTS}
    if options.model in IMAGE_CONDITIONED_MODELS:  # editing / image-to-video: a source image per prompt
        rows["image"] = tiny_condition_images(len(PROMPTS))
    if options.model in LAST_FRAME_MODELS:
        rows["last_image"] = tiny_condition_images(2 * len(PROMPTS))[len(PROMPTS) :]
    trainer = DanceGRPOTrainer(model, "brightness", args=args, train_dataset=Dataset.from_dict(rows), peft_config=peft)
    trainer.policy.runtime.trim_text = not options.padded_text
    device = trainer.accelerator.device
    recorder = CallRecorder(trainer) if floor else None
    clock = _StepClock(device, trainer)
    trainer.add_callback(clock)
    starts, rollouts = [], []  # per round: start time, rollout seconds
    generate = trainer._generate_and_score
    # The last round is profiled (kernel classes per phase) when asked: the profiler starts before its rollout's
    # clock and stops after its step's, so its post-processing stays out of the timed windows.
    profiler = RoundProfiler() if options.profile else None
    profiled_round = warmup + options.rounds - 1

    def timed_generate(rows):
        if recorder:
            recorder.enabled = len(starts) >= warmup
            recorder.phase = "rollout"
        synchronize(device)
        if profiler and len(starts) == profiled_round:
            profiler.start()
        starts.append(time.perf_counter())
        with phase("rollout"):
            generate(rows)
            synchronize(device)
        rollouts.append(time.perf_counter() - starts[-1])
        progress(f"round {len(starts)}: rollout of {len(rows)} prompts in {rollouts[-1]:.1f} s")
        if recorder:
            recorder.phase = "train"
        if profiler and len(starts) == profiled_round + 1:
            clock.train_range = phase("train")
            clock.train_range.__enter__()

    trainer._generate_and_score = timed_generate
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    counters.clear()  # dynamo's: graphs compiled and graph breaks, this run's
    trainer.train()
    if profiler:
        trace = os.path.join(options.profile, f"trace_{os.getpid()}.json")
        kernels = profiler.stop(trace)
        os.remove(trace)  # hundreds of MB at full size; the breakdown is what is kept
        progress("profile of the last round:\n" + "\n".join(summary_line(n, f) for n, f in kernels.items()))
    # Median round × rounds: one scheduler hiccup on a shared machine does not decide the ratio.
    rounds_timed = len(starts) - warmup
    rollout = statistics.median(rollouts[warmup:]) * rounds_timed
    train = (
        statistics.median(
            [
                end - start - seconds
                for start, seconds, end in zip(starts[warmup:], rollouts[warmup:], clock.ends[warmup:])
            ]
        )
        * rounds_timed
    )
    result = {"wall_s": rollout + train, "rollout_s": rollout, "train_s": train}
    result["peak_mem_mb"] = peak_memory_mb(device)
    # The trainer's own closed-form count (what perf/denoiser_tflops logs) per phase, beside torch's count of the
    # replayed calls: the timed rounds' median, as for the times.
    rollout_tflops = statistics.median(clock.rollout_flops[warmup:]) * rounds_timed / 1e12
    train_tflops = statistics.median(clock.train_flops[warmup:]) * rounds_timed / 1e12
    result["denoiser_tflops"] = rollout_tflops + train_tflops
    result["tflops_per_s"] = result["denoiser_tflops"] / result["wall_s"]
    peak = peak_tflops(device)
    if peak:
        result["mfu_rollout"] = rollout_tflops / rollout / peak
        result["mfu_train"] = train_tflops / train / peak
    if profiler:
        result["kernels"] = kernels
    if args.torch_compile:  # whole blocks: one graph per block class and grad mode (a few more per text length)
        result["compiled"] = {
            "graphs": clock.graphs[-1],
            "graphs_compiled_in_timed_rounds": clock.graphs[-1] - clock.graphs[warmup - 1],
            "graph_breaks": sum(counters["graph_break"].values()),
        }
    progress(f"trained {len(starts)} rounds; replaying the recorded calls for the floor" if recorder else "trained")
    if not recorder:  # MFU from the trainer's closed-form count alone
        result["mfu"] = result["tflops_per_s"] / peak if peak else None
    else:
        result["floor_s"] = recorder.floor_seconds()
        result["denoiser_calls"] = recorder.count("denoiser")
        result["model_flops"] = recorder.flops()
        result["mfu"] = result["model_flops"] / result["wall_s"] / (peak * 1e12) if peak else None
        recorder.remove()
    release(trainer)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, default_model="tiny-flux")
    parser.add_argument("--steps", type=int, default=6, help="denoising steps per sample")
    parser.add_argument("--generations", type=int, default=4, help="samples per prompt")
    parser.add_argument("--batch", type=int, default=None, help="samples per round: default 16 (tiny), 8 (real)")
    parser.add_argument(
        "--train-batch", type=int, default=None, help="transitions per micro-batch: default 16 (tiny), 2 (real)"
    )
    parser.add_argument("--timestep-fraction", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds after a warm-up: 6 (tiny), 2 (real)")
    parser.add_argument("--torch-compile", action="store_true", help="the Trainer's torch_compile (the denoiser)")
    parser.add_argument("--attention-backend", default=None, help="the config's attention_backend (diffusers')")
    parser.add_argument("--cudnn-attention", action="store_true", help="the config's cudnn_attention")
    parser.add_argument("--rollout-backprop", action="store_true", help="recompute-free GRPO (the config's)")
    parser.add_argument(
        "--padded-text", action="store_true",
        help="masked-text families: keep the text padded to max_sequence_length (the cost before trimming)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", metavar="DIR", default=None,
        help="profile the last timed round (kernel classes per phase; its trace written to DIR, then removed)",
    )  # fmt: skip
    parser.add_argument("--guidance-scale", type=float, default=3.5, help="the config's (Z-Image-Turbo: 0, no CFG)")
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="skip replaying the recorded calls (no overhead ratio; MFU from the trainer's closed-form count): the "
        "replay takes as long as the timed rounds, too long for 14B video models in one device call",
    )
    options = parser.parse_args(argv)
    tiny = is_tiny(options.model)
    options.batch = options.batch or (16 if tiny else 8)
    options.train_batch = options.train_batch or (16 if tiny else 2)
    options.rounds = options.rounds or (6 if tiny else 2)
    try:
        return _benchmark(options)
    except torch.cuda.OutOfMemoryError as error:
        return out_of_memory(options, error)


def _benchmark(options) -> dict:
    use_cpu = not torch.cuda.is_available()
    size = resolution(options)
    with tempfile.TemporaryDirectory() as workdir:
        model = build_model(options.model, workdir, layers=options.layers)
        progress(f"built {options.model}")
        transitions_per_sample = max(1, int((options.steps - 1) * options.timestep_fraction))
        transitions = options.batch * transitions_per_sample
        micro_steps = transitions // options.train_batch

        def config(rollout_batch, train_batch, accumulation, rounds):
            return DanceGRPOConfig(
                output_dir=os.path.join(workdir, "out"),
                use_cpu=use_cpu,
                bf16=options.bf16,
                report_to="none",
                save_strategy="no",
                disable_tqdm=True,
                logging_steps=10_000,
                seed=0,
                num_generations=options.generations,
                generation_batch_size=options.batch,
                rollout_batch_size=rollout_batch,
                num_inference_steps=options.steps,
                timestep_fraction=options.timestep_fraction,
                eta=1.0,
                guidance_scale=options.guidance_scale,
                height=size,
                width=size,
                num_frames=num_frames(options),
                max_sequence_length=32 if is_tiny(options.model) else 512,
                pipeline_kwargs=PIPELINE_KWARGS.get(options.model),
                per_device_train_batch_size=train_batch,
                gradient_accumulation_steps=accumulation,
                activation_checkpointing=options.gradient_checkpointing,
                torch_compile=options.torch_compile,
                attention_backend=options.attention_backend,
                cudnn_attention=options.cudnn_attention,
                rollout_backprop=options.rollout_backprop,
                learning_rate=1e-4,
                max_steps=rounds,  # one optimizer update per round
                **CONFIG_OVERRIDES.get(options.model, {}),
            )

        # A compiled run's first calls with gradients run eager (the FLOP counter's probe) and the next ones compile:
        # in the training phase of the first round, but with rollout_backprop in the rollout of the second.
        warmup = 2 if options.torch_compile and options.rollout_backprop else 1
        ours = timed_run(
            model, config(None, options.train_batch, micro_steps, warmup + options.rounds), options, warmup,
            floor=not options.no_floor,
        )  # fmt: skip
        batch1 = None
        if not options.skip_batch1:
            profile, options.profile = options.profile, None  # the batched run's profile is the one asked for
            batch1 = timed_run(model, config(1, 1, transitions, warmup + options.rounds), options, warmup, floor=False)
            options.profile = profile

    samples = options.batch * options.rounds
    floor = {phase: sum(by_name.values()) for phase, by_name in ours.get("floor_s", {}).items()}
    figures = {
        "model": options.model,
        "options": vars(options),
        "device": describe_device(torch.device("cpu" if use_cpu else "cuda")),
        "resolution": size,
        "frames": num_frames(options),
        "steps": options.steps,
        "samples": samples,
        "transitions": transitions * options.rounds,
        "rollout_s_per_sample": ours["rollout_s"] / samples,
        "train_s_per_item": ours["train_s"] / (transitions * options.rounds),
        "peak_mem_mb": ours["peak_mem_mb"],
        "overhead_ratio": ours["wall_s"] / sum(floor.values()) if floor else None,
        # Per phase only where each phase's calls ran in it (rollout_backprop's backwards run in training but replay
        # with their rollout calls).
        "rollout_overhead_ratio": ours["rollout_s"] / floor["rollout"] if "train" in floor else None,
        "train_overhead_ratio": ours["train_s"] / floor["train"] if "train" in floor else None,
        "floor_s": ours.get("floor_s"),
        "wall_s": ours["wall_s"],
        "batch1_speedup": batch1["wall_s"] / ours["wall_s"] if batch1 else None,
        "model_tflops": ours["model_flops"] / 1e12 if "model_flops" in ours else None,
        "mfu": ours["mfu"],
        "mfu_rollout": ours.get("mfu_rollout"),
        "mfu_train": ours.get("mfu_train"),
        "kernels": ours.get("kernels"),
        "compiled": ours.get("compiled"),
        "denoiser_tflops": ours["denoiser_tflops"],
        "tflops_per_s": ours["tflops_per_s"],
    }
    ratio = {
        phase: "–" if figures[key] is None else f"{figures[key]:.2f}"
        for phase, key in (("rollout", "rollout_overhead_ratio"), ("train", "train_overhead_ratio"),
                           ("overall", "overhead_ratio"))
    }  # fmt: skip
    print(
        f"{options.model} @ {size}px, {options.steps} steps, {samples} samples / {transitions * options.rounds} "
        f"transitions timed on {figures['device']}:\n"
        f"  rollout  {figures['rollout_s_per_sample'] * 1e3:9.2f} ms/sample      floor ratio {ratio['rollout']}\n"
        f"  training {figures['train_s_per_item'] * 1e3:9.2f} ms/transition  floor ratio {ratio['train']}\n"
        f"  overall overhead ratio {ratio['overall']}, peak memory {figures['peak_mem_mb']:.0f} MB"
        + (f", {figures['batch1_speedup']:.2f}x faster than batch size 1" if batch1 else "")
    )
    return emit(figures)


if __name__ == "__main__":
    main()
