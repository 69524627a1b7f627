"""Two real CPU processes (gloo) compute what one process computes for the same global batch."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "multiprocess_grpo.py")


def _launch(num_processes, model_dir, tmp_path, script=SCRIPT, *extra, name=""):
    output_dir, result = tmp_path / f"out{num_processes}{name}", tmp_path / f"result{num_processes}{name}.json"
    # `accelerate launch --cpu --num_processes 2` silently runs one process; --multi_gpu with ACCELERATE_USE_CPU
    # starts two that talk over gloo.
    launcher = ["--multi_gpu", "--num_processes", "2"] if num_processes == 2 else ["--num_processes", "1"]
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher,
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(29500 + num_processes),
        script,
        model_dir,
        str(output_dir),
        str(result),
        *extra,
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with open(result) as handle:
        return json.load(handle)


def test_two_processes_compute_the_same_advantages_as_one(tiny_model_dir, tmp_path):
    one = _launch(1, tiny_model_dir("flux"), tmp_path)
    two = _launch(2, tiny_model_dir("flux"), tmp_path)
    assert (tmp_path / "out2" / "pytorch_lora_weights.safetensors").exists()
    assert (one["num_processes"], two["num_processes"]) == (1, 2)
    assert len(one["rounds"]) == len(two["rounds"]) >= 1
    for a, b in zip(one["rounds"], two["rounds"]):
        assert a["prompts"] == b["prompts"]  # the same global batch, groups intact across the two processes
        assert b["rewards"] == pytest.approx(a["rewards"], abs=1e-5)
        assert b["advantages"] == pytest.approx(a["advantages"], abs=1e-3)
    # A group-wise reward that abstains on some prompts: its log_metric values are averaged over calls and processes
    # alike, and its statistics are over the rows it scored.
    logged = [entry for entry in one["logged"] if entry]
    assert logged and logged == [pytest.approx(entry, abs=1e-5, nan_ok=True) for entry in two["logged"] if entry]


def test_two_processes_with_a_rollout_worker_train_as_in_process(tiny_model_dir, tmp_path):
    """Two training processes whose chunks one `trl-dance serve-rollouts` worker samples: after 2 rounds the LoRA and
    every round's rewards and advantages are the in-process run's, bit for bit."""
    from safetensors.torch import load_file
    from test_rollout_workers import _cli_worker

    model_dir = tiny_model_dir("flux")
    local = _launch(2, model_dir, tmp_path, SCRIPT, "local", name="local")
    with _cli_worker(model_dir) as url:
        remote = _launch(2, model_dir, tmp_path, SCRIPT, url, name="worker")
    assert len(local["rounds"]) == len(remote["rounds"]) == 2
    assert local["rounds"] == remote["rounds"]
    a, b = (load_file(tmp_path / f"out2{name}" / "pytorch_lora_weights.safetensors") for name in ("local", "worker"))
    assert set(a) == set(b) and all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize(("trainer", "kind"), [("grpo", "flux"), ("nft", "flux"), ("dmd", "flux"), ("dpo", "sd")])
def test_two_processes_resume_exactly_across_epochs(tiny_model_dir, tmp_path, trainer, kind):
    """Two processes, 3 epochs of 2 rounds (GRPO) or steps (DPO), interrupted in the middle of epoch 2: the resumed
    run's LoRA (and DMD's fake score and GAN head, the same on both processes) is bit-identical to the uninterrupted
    run's. DMD runs RTDMD's stage 2 (PPO, DMD and AC-DMD's fake score) with the GAN and a teacher from another
    checkpoint."""
    from trl_dance.testing import save_tiny_pipeline

    script = os.path.join(ROOT, "tests", "multiprocess_resume.py")
    teacher = [save_tiny_pipeline(kind, str(tmp_path / "teacher"), seed=1)] if trainer == "dmd" else []
    result = _launch(2, tiny_model_dir(kind), tmp_path, script, trainer, *teacher)
    assert result == {"num_processes": 2, "epoch": 3.0, "different": []}


def test_num_processes_2_on_cpus_starts_two_gloo_processes_in_one_launch(tiny_model_dir, tmp_path):
    """`trl-dance grpo --num_processes 2` on a machine without GPUs (accelerate alone would start one process): two
    processes over gloo, as docs/scaling.md shows it with the tiny recipe."""
    recipe = os.path.join(ROOT, "recipes", "configs", "grpo_flux_tiny.yaml")
    command = [sys.executable, "-m", "trl_dance.cli", "grpo", "--config", recipe, "--model_name_or_path",
               tiny_model_dir("flux"), "--output_dir", str(tmp_path / "out"), "--num_processes", "2",
               "--gradient_accumulation_steps", "5", "--max_steps", "1", "--num_sample_images", "0"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    # The recipe's accumulation (10, one update per round on one process) checked for two: a round is 5 micro-batches
    # per process, and the refusal names the value that works.
    planned = subprocess.run(command[:-6] + ["--max_steps", "1"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert planned.returncode == 2 and "(5 makes one update per round)" in planned.stderr, planned.stderr[-2000:]
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "trl-dance: 2 CPU processes over gloo" in completed.stdout
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").exists()
