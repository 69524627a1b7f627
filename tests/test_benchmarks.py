"""The benchmark scripts run end to end on the tiny models and report every figure the README table uses."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"rollout_s_per_sample", "train_s_per_item", "peak_mem_mb", "overhead_ratio", "batch1_speedup"}


@pytest.mark.parametrize(
    ("script", "arguments"),
    [
        ("grpo_iteration.py", ["--rounds", "2", "--batch", "8", "--train-batch", "8"]),
        ("dpo_step.py", ["--steps", "2", "--batch", "4"]),
    ],
)
def test_benchmark_prints_its_figures(script, arguments):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *arguments],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(figures) >= KEYS
    for key in ("train_s_per_item", "peak_mem_mb", "overhead_ratio", "batch1_speedup"):
        assert figures[key] > 0, key
    assert figures["floor_s"]["train"]["denoiser"] > 0
    if script == "grpo_iteration.py":
        assert figures["rollout_s_per_sample"] > 0
        assert set(figures["floor_s"]["rollout"]) >= {"denoiser", "vae.decode", "text_encode", "reward"}
    else:
        assert figures["rollout_s_per_sample"] is None
        assert set(figures["floor_s"]["train"]) >= {"denoiser", "vae.encode", "text_encode"}
