"""Run the benchmark configurations of docs/benchmarks.md, each in its own process, and print its tables.

    python benchmarks/matrix.py cpu --repeats 3                  # the tiny models (the CPU table)
    python benchmarks/matrix.py gpu --only grpo-flux-lora64      # FLUX.1-dev / SD3.5-medium architectures
    python benchmarks/matrix.py --table results.jsonl            # the table of earlier results

Each run's JSON line (see grpo_iteration.py, dpo_step.py) is appended to ``--output`` with its configuration's
name, so runs split over several sessions or calls add up; a run that fails or times out is recorded as such.
The table gives per configuration the median over its runs (the overhead ratio with its range).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _real(script: str, model: str, lora_rank: int, *more: str) -> list[str]:
    """A real architecture in bf16 at 512² (the scripts' defaults for it)."""
    return [script, "--model", model, "--bf16", "--lora-rank", str(lora_rank), *more]


_ONE_ROUND = ("--batch", "4", "--generations", "2", "--rounds", "1", "--skip-batch1")
_LARGE = ("--gradient-checkpointing", *_ONE_ROUND)
# 14B-class video: the floor's replay would double a round of about 130 s (Wan 14B, 33 frames, H200); a timestep
# fraction of 0.4 (2 of 5 transitions trained) as in the papers' recipes keeps a row inside one device call.
_VIDEO_LARGE = (*_LARGE, "--no-floor", "--timestep-fraction", "0.4")

# The issue-55 rows: the model and size, and the fast path (compiled, cuDNN attention through diffusers' dispatcher).
_FLUX_1024 = ("flux-dev", 64, "--resolution", "1024")
_WAN14B_33F = ("wan21-14b", 64, "--resolution", "480", "--frames", "33")
_HUNYUAN15_33F = ("hunyuan-video15", 64, "--resolution", "480", "--frames", "33", "--guidance-scale", "6")
_FAST = ("--torch-compile", "--attention-backend", "_native_cudnn")

CONFIGURATIONS: dict[str, dict[str, list[str]]] = {
    "cpu": {
        "grpo-tiny-flux": ["grpo_iteration.py", "--model", "tiny-flux"],
        "grpo-tiny-flux-rollout-backprop": ["grpo_iteration.py", "--model", "tiny-flux", "--rollout-backprop"],
        "grpo-tiny-sd3": ["grpo_iteration.py", "--model", "tiny-sd3"],
        "grpo-tiny-sd": ["grpo_iteration.py", "--model", "tiny-sd"],
        "grpo-tiny-sdxl": ["grpo_iteration.py", "--model", "tiny-sdxl"],
        "grpo-tiny-wan": ["grpo_iteration.py", "--model", "tiny-wan"],
        "grpo-tiny-qwen-image": ["grpo_iteration.py", "--model", "tiny-qwen-image"],
        "grpo-tiny-hunyuan-video": ["grpo_iteration.py", "--model", "tiny-hunyuan-video"],
        "grpo-tiny-flux-kontext": ["grpo_iteration.py", "--model", "tiny-flux-kontext"],
        "grpo-tiny-skyreels-i2v": ["grpo_iteration.py", "--model", "tiny-skyreels-i2v"],
        "grpo-tiny-flux2-klein": ["grpo_iteration.py", "--model", "tiny-flux2-klein"],
        "grpo-tiny-z-image": ["grpo_iteration.py", "--model", "tiny-z-image", "--guidance-scale", "0"],
        "grpo-tiny-hunyuan-video15": ["grpo_iteration.py", "--model", "tiny-hunyuan-video15", "--guidance-scale", "6"],
        "grpo-tiny-qwen-image-edit": ["grpo_iteration.py", "--model", "tiny-qwen-image-edit", "--guidance-scale", "4"],
        "grpo-tiny-qwen-image21": ["grpo_iteration.py", "--model", "tiny-qwen-image21"],
        "grpo-tiny-hunyuan-video15-i2v": [
            "grpo_iteration.py",
            "--model",
            "tiny-hunyuan-video15-i2v",
            "--guidance-scale",
            "6",
        ],  # fmt: skip
        "grpo-tiny-ltx2": ["grpo_iteration.py", "--model", "tiny-ltx2", "--guidance-scale", "3"],
        "grpo-tiny-ltx2-i2v": ["grpo_iteration.py", "--model", "tiny-ltx2-i2v", "--guidance-scale", "3"],
        "grpo-tiny-wan-flf2v": ["grpo_iteration.py", "--model", "tiny-wan-flf2v", "--guidance-scale", "5"],
        "grpo-tiny-minimax-h3": ["grpo_iteration.py", "--model", "tiny-minimax-h3", "--guidance-scale", "1"],
        "dpo-tiny-sd": ["dpo_step.py", "--model", "tiny-sd"],
        "dpo-tiny-sd3": ["dpo_step.py", "--model", "tiny-sd3"],
    },
    # Most informative first: a session with little device time runs the head of the list.
    "gpu": {
        "grpo-flux-lora64": _real("grpo_iteration.py", "flux-dev", 64),
        "grpo-flux-lora64-gc": _real("grpo_iteration.py", "flux-dev", 64, "--gradient-checkpointing"),
        "grpo-sd35-lora64": _real("grpo_iteration.py", "sd35-medium", 64),
        "grpo-sd35-full": _real("grpo_iteration.py", "sd35-medium", 0),
        "grpo-sd35-full-gc": _real("grpo_iteration.py", "sd35-medium", 0, "--gradient-checkpointing"),
        "grpo-flux-full-gc": _real("grpo_iteration.py", "flux-dev", 0, "--gradient-checkpointing"),
        # One round of 4: at 2 rounds of 8 with the batch-1 comparison its VAE decodes at 480×832×33 did not finish in
        # 320 s on an H200.
        "grpo-wan-lora64": _real(
            "grpo_iteration.py", "wan21-1.3b", 64, "--resolution", "480", "--frames", "33", *_ONE_ROUND
        ),
        "dpo-flux-lora64": _real("dpo_step.py", "flux-dev", 64, "--batch", "4"),
        "dpo-sd35-lora64": _real("dpo_step.py", "sd35-medium", 64, "--batch", "4"),
        # Full-size families (rollout batch 4, one timed round, no batch-size-1 comparison: under 10 minutes each).
        "grpo-flux-1024-lora64-gc": _real("grpo_iteration.py", "flux-dev", 64, "--resolution", "1024", *_LARGE),
        "grpo-qwen-image-lora64-gc": _real("grpo_iteration.py", "qwen-image", 64, *_LARGE),
        "grpo-wan14b-33f-lora64-gc": _real(
            "grpo_iteration.py", "wan21-14b", 64, "--resolution", "480", "--frames", "33", *_VIDEO_LARGE
        ),
        "grpo-hunyuan-33f-lora64-gc": _real(
            "grpo_iteration.py", "hunyuan-video", 64, "--resolution", "480", "--frames", "33", *_VIDEO_LARGE
        ),
        "grpo-flux2-klein-base-1024-lora64-gc": _real(
            "grpo_iteration.py", "flux2-klein-base-4b", 64, "--resolution", "1024", "--guidance-scale", "4", *_LARGE
        ),
        "grpo-z-image-turbo-1024-lora64-gc": _real(
            "grpo_iteration.py", "z-image-turbo", 64, "--resolution", "1024", "--guidance-scale", "0", *_LARGE
        ),
        "grpo-hunyuan15-33f-lora64-gc": _real(
            "grpo_iteration.py",
            "hunyuan-video15",
            64,
            "--resolution",
            "480",
            "--frames",
            "33",
            "--guidance-scale",
            "6",
            *_VIDEO_LARGE,
        ),
        "grpo-wan14b-81f-lora64-gc": _real(
            "grpo_iteration.py", "wan21-14b", 64, "--resolution", "480", "--frames", "81", *_VIDEO_LARGE
        ),
        # Issue 55, speed at full size (run by benchmarks/gpu_session.sh): FLUX.1-dev 1024² compiled (regional
        # torch.compile); then with cuDNN's attention through diffusers' dispatcher (what attention_backend="auto"
        # picks on Hopper; SDPA's own cudnn_attention flag left it on flash: the -sdpa-cudnn-flag record); then
        # recompute-free (the graphs of the 20 trained transitions held until the rewards); and without
        # checkpointing at a training micro-batch of 1 (an H200's 139 GB).
        "grpo-flux-1024-lora64-gc-compile": _real("grpo_iteration.py", *_FLUX_1024, "--torch-compile", *_LARGE),
        "grpo-flux-1024-lora64-gc-compile-cudnn": _real("grpo_iteration.py", *_FLUX_1024, *_FAST, *_LARGE),
        "grpo-flux-1024-lora64-gc-compile-cudnn-backprop": _real(
            "grpo_iteration.py", *_FLUX_1024, *_FAST, "--rollout-backprop", *_LARGE
        ),
        "grpo-flux-1024-lora64-compile-tb1": _real(
            "grpo_iteration.py", *_FLUX_1024, "--torch-compile", "--train-batch", "1", *_ONE_ROUND
        ),
        "grpo-wan14b-33f-lora64-gc-compile-cudnn": _real("grpo_iteration.py", *_WAN14B_33F, *_FAST, *_VIDEO_LARGE),
        "grpo-hunyuan15-33f-lora64-gc-compile": _real(
            "grpo_iteration.py", *_HUNYUAN15_33F, "--torch-compile", *_VIDEO_LARGE
        ),
        # Masked text trimmed to a batch's longest prompt (40-48 tokens here) against the pipelines' padding (Qwen-Image:
        # 512 tokens beside 4,096 image tokens; HunyuanVideo 1.5: 1,000 + 256 beside 14,040 video tokens).
        "grpo-qwen-image-lora64-gc-compile": _real("grpo_iteration.py", "qwen-image", 64, "--torch-compile", *_LARGE),
        "grpo-qwen-image-lora64-gc-compile-padded": _real(
            "grpo_iteration.py", "qwen-image", 64, "--torch-compile", "--padded-text", *_LARGE
        ),
        "grpo-hunyuan15-33f-lora64-gc-compile-padded": _real(
            "grpo_iteration.py", *_HUNYUAN15_33F, "--torch-compile", "--padded-text", *_VIDEO_LARGE
        ),
        # LTX-2 at the pipeline's guidance (CFG 3 / 7, STG, modality isolation, rescale: four forwards a step).
        "grpo-ltx2-33f-lora64-gc": _real(
            "grpo_iteration.py", "ltx2", 64, "--frames", "33", "--guidance-scale", "3", *_VIDEO_LARGE
        ),
        # MiniMax-H3 (33B) at its shortest clip, 124 frames (5 s) at 512²: ~9.9k packed rows, one forward a step.
        "grpo-minimax-h3-124f-lora64-gc": _real(
            "grpo_iteration.py", "minimax-h3", 64, "--guidance-scale", "1", *_VIDEO_LARGE
        ),
    },
}


def run(name: str, command: list[str], timeout: float, extra: list[str]) -> dict:
    """One configuration in a fresh process: its JSON figures, or why there are none."""
    start = time.perf_counter()
    path = os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
    try:
        result = subprocess.run(
            [sys.executable, os.path.join(HERE, command[0]), *command[1:], *extra],
            capture_output=True, text=True, timeout=timeout, env={"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONPATH": path},
        )  # fmt: skip
    except subprocess.TimeoutExpired as timed_out:
        # What the run printed before it was stopped says where its time went (a device call sees it at once).
        tails = {}
        for stream in ("stdout", "stderr"):
            text = getattr(timed_out, stream) or ""
            text = text.decode(errors="replace") if isinstance(text, bytes) else text
            tails[f"{stream}_tail"] = "\n".join(line for line in text.splitlines() if not line.startswith("["))[-4000:]
        return {"name": name, "failed": f"timed out after {timeout:.0f} s", **tails}
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        errors = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("[")]
        # The traceback's tail travels with the record: a device session sees why without a second run.
        return {
            "name": name,
            "failed": f"exit {result.returncode}: {errors[-1][-300:] if errors else ''}",
            "stderr_tail": "\n".join(errors[-40:])[-4000:],
        }
    return {"name": name, **json.loads(lines[-1]), "process_s": time.perf_counter() - start}


def _format(value: float | None, unit: str = "", spec: str = ".3g") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def _median(runs: list[dict], key: str, scale: float = 1.0) -> float | None:
    values = [run[key] * scale for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else None


def _row(name: str, runs: list[dict]) -> str:
    done = [r for r in runs if "failed" not in r and not r.get("out_of_memory")]
    device = next((r["device"] for r in runs if "device" in r), "–")
    if not done:
        why = "out of memory" if any(r.get("out_of_memory") for r in runs) else runs[-1].get("failed", "")
        return f"| {name} | {device} | {why[:80]} | | | | | | | {len(runs)} |"
    ratios = [r["overhead_ratio"] for r in done if r.get("overhead_ratio") is not None]  # none: run with --no-floor
    spread = f" ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else ""
    overhead = f"{statistics.median(ratios):.2f}{spread}" if ratios else "–"
    return (
        f"| {name} | {device} | {_format(_median(done, 'rollout_s_per_sample', 1e3))} | "
        f"{_format(_median(done, 'train_s_per_item', 1e3))} | {_format(_median(done, 'peak_mem_mb'), spec='.0f')} | "
        f"{overhead} | {_format(_median(done, 'batch1_speedup'), '×')} | "
        f"{_format(_median(done, 'tflops_per_s'))} | {_format(_median(done, 'mfu', 100), ' %')} | {len(done)} |"
    )


def table(records: list[dict]) -> str:
    """A markdown table: one row per configuration, medians over its successful runs."""
    names = dict.fromkeys(record["name"] for record in records)
    return "\n".join(
        [
            "| configuration | device | rollout ms/sample | train ms/item | peak memory MB | overhead ratio | "
            "batch-1 speed-up | TFLOP/s | MFU | runs |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *[_row(name, [r for r in records if r["name"] == name]) for name in names],
        ]
    )


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", nargs="?", choices=sorted(CONFIGURATIONS), help="configurations to run")
    parser.add_argument("--only", nargs="+", default=None, help="names of configurations of the suite to run")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds per run")
    parser.add_argument(
        "--budget", type=float, default=None,
        help="seconds for all runs: each run's timeout is cut to what is left, none starts with under 30 s left",
    )  # fmt: skip
    parser.add_argument("--output", default="benchmark_results.jsonl", help="JSON lines, appended to")
    parser.add_argument("--table", metavar="JSONL", default=None, help="only print the table of this file")
    parser.add_argument("--markdown", metavar="FILE", default=None, help="also write the table to FILE")
    options, extra = parser.parse_known_args(argv)  # unknown options go to every script (e.g. --rounds 2)
    if options.table:
        with open(options.table) as handle:
            text = table([json.loads(line) for line in handle if line.strip()])
        print(text)
        return text
    if options.suite is None:
        parser.error("name a suite (cpu or gpu) or --table")
    suite = CONFIGURATIONS[options.suite]
    unknown = set(options.only or []) - set(suite)
    if unknown:
        parser.error(f"not in the {options.suite} suite: {sorted(unknown)}; it has {list(suite)}")
    records = []
    deadline = time.perf_counter() + options.budget if options.budget else float("inf")
    names = options.only or list(suite)  # in the order asked for: a device call's budget runs the head first
    for name in names:
        command = suite[name]
        for _ in range(options.repeats):
            left = deadline - time.perf_counter()
            if left < 30:
                record = {"name": name, "failed": "not run: the call's budget was spent"}
            else:
                record = run(name, command, min(options.timeout, left), extra)
            print(json.dumps(record), flush=True)
            with open(options.output, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            records.append(record)
    text = table(records)
    print(text)
    if options.markdown:
        with open(options.markdown, "w") as handle:
            handle.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
