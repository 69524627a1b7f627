"""The benchmark scripts run end to end on the tiny models, through the matrix runner, and report every figure the
README table uses."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import matrix  # noqa: E402

KEYS = {"rollout_s_per_sample", "train_s_per_item", "peak_mem_mb", "overhead_ratio", "batch1_speedup"}


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("grpo-tiny-flux", ["--rounds", "2", "--batch", "8", "--train-batch", "8"]),
        ("grpo-tiny-wan", ["--rounds", "1", "--batch", "4", "--train-batch", "4"]),
        ("dpo-tiny-sd", ["--steps", "2", "--batch", "4"]),
    ],
)
def test_benchmark_prints_its_figures(name, arguments, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    figures = matrix.run(name, matrix.CONFIGURATIONS["cpu"][name], timeout=600, extra=arguments)
    assert "failed" not in figures, figures["failed"]
    assert set(figures) >= KEYS
    for key in ("train_s_per_item", "peak_mem_mb", "overhead_ratio", "batch1_speedup"):
        assert figures[key] > 0, key
    assert figures["floor_s"]["train"]["denoiser"] > 0
    if name.startswith("grpo"):
        assert figures["rollout_s_per_sample"] > 0
        assert set(figures["floor_s"]["rollout"]) >= {"denoiser", "vae.decode", "text_encode", "reward"}
    else:
        assert figures["rollout_s_per_sample"] is None
        assert set(figures["floor_s"]["train"]) >= {"denoiser", "vae.encode", "text_encode"}
    row = matrix.table([figures]).splitlines()[-1]
    assert row.startswith(f"| {name} | cpu") and f"{figures['overhead_ratio']:.2f}" in row


def test_table_reports_medians_and_failures():
    ok = {"device": "GPU", "rollout_s_per_sample": None, "peak_mem_mb": 10.0, "batch1_speedup": None, "mfu": 0.25}
    records = [
        {"name": "a", **ok, "train_s_per_item": 0.001, "overhead_ratio": 1.5},
        {"name": "a", **ok, "train_s_per_item": 0.003, "overhead_ratio": 1.1},
        {"name": "a", **ok, "train_s_per_item": 0.002, "overhead_ratio": 1.2},
        {"name": "b", "device": "GPU", "out_of_memory": True},
        {"name": "c", "failed": "timed out after 5 s"},
    ]
    rows = matrix.table(records).splitlines()
    assert rows[2] == "| a | GPU | – | 2 | 10 | 1.20 (1.10–1.50) | – | – | 25 % | 3 |"
    assert rows[3].startswith("| b | GPU | out of memory |")
    assert rows[4].startswith("| c | – | timed out after 5 s |")


def test_a_timed_out_run_keeps_what_it_printed(tmp_path):
    """A device call sees where a run's time went without a second run: its output up to the timeout."""
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, time\nprint('progress 0.1 s: built', file=sys.stderr, flush=True)\ntime.sleep(60)\n"
    )
    record = matrix.run("slow", [str(script)], timeout=5, extra=[])
    assert record["failed"] == "timed out after 5 s" and "progress 0.1 s: built" in record["stderr_tail"]


@pytest.mark.parametrize("script", ["grpo_iteration", "dpo_step"])
def test_runs_share_one_pipeline_instance(script, tiny_model_dir, monkeypatch):
    """The real architectures are built once as a pipeline instance that both runs (ours and batch size 1) train:
    the first run must give back its LoRA adapter and its recorder's hooks."""
    from diffusers import DiffusionPipeline

    module = __import__(script)
    kind = "flux" if script == "grpo_iteration" else "sd"
    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dir(kind))
    monkeypatch.setattr(module, "build_model", lambda *args, **kwargs: pipeline)
    arguments = ["--rounds", "1", "--train-batch", "8"] if kind == "flux" else ["--steps", "1"]
    figures = module.main(["--model", f"tiny-{kind}", "--batch", "8" if kind == "flux" else "4", *arguments])
    assert figures["batch1_speedup"] > 0
    denoiser = pipeline.transformer if kind == "flux" else pipeline.unet
    assert not getattr(denoiser, "peft_config", None) and not denoiser._forward_pre_hooks
    assert "encode" not in vars(pipeline.vae) and "decode" not in vars(pipeline.vae)


def test_efficiency_benchmark_counts_work_and_compares_to_dancegrpo(monkeypatch):
    """benchmarks/efficiency.py end to end on two short runs: the denoiser work it counts is the plan's (rollout rows
    + 3 × trained transitions), evaluated before and after every round."""
    import efficiency

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    figures = efficiency.main(
        ["--seeds", "0", "--rounds", "2", "--eval-every", "1", "--steps", "6", "--batch", "8", "--target", "0.01"]
        + ["--methods", "flow_grpo_fast_branching"]
    )
    dance, fast = figures["methods"]["dancegrpo"], figures["methods"]["flow_grpo_fast_branching"]
    assert dance["work_per_round"] == 8 * 6 + 3 * 8 * 3  # 6 steps rolled out, 60 % of 5 = 3 trained
    # A 2-step window in the first 3 steps: 2 groups share the prefix before it, 8 samples take the rest.
    assert 8 * (6 - 2) + 3 * 8 * 2 <= fast["work_per_round"] <= 8 * 6 + 3 * 8 * 2
    # Beside the rows, the trainer's closed-form TFLOPs (training only: evaluations are taken out).
    assert dance["tflops_per_round"] > 0 and dance["tflops_ratio"] == dance["work_ratio"] == 1.0
    assert len(dance["work_ratio_per_seed"]) == 1 and len(dance["gains_per_seed"][0]) == 3  # before, after 1, 2
    assert figures["best_method"] in (None, "flow_grpo_fast_branching")
