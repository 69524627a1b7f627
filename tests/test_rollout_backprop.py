"""Recompute-free GRPO (`rollout_backprop`): the update taken through the rollout's own differentiable forwards is
the update of the standard path, which recomputes every trained transition in training micro-batches."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import LORA_TARGETS, PROMPTS, family_overrides, tiny_grpo_config
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOConfig, DanceGRPOTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# SGD: the move is linear in the gradient, so "1e-4 of the move" compares gradients (Adam's first step, ≈ lr·sign(g),
# would amplify rounding in near-zero gradient entries).
CASES = {
    "flux-lora": ("flux", {}),
    "sd3-cfg-checkpointing": ("sd3", {"guidance_scale": 4.0, "activation_checkpointing": True}),
    "flux-window-branching-reweighted": (
        "flux",
        {
            "sde_window_size": 3,
            "branching": True,
            "share_initial_noise": "group",
            "step_reweighting": True,
            "gradient_accumulation_steps": 3,
            "per_device_train_batch_size": 8,
        },
    ),  # fmt: skip
    "wan-full-fine-tuning": ("wan", {"learning_rate": 3.0}),  # (its second round amplifies rounding: 4e-5 at lr 10)
}


def _train(model_dir, output_dir, kind, lora, **overrides):
    values = {"optim": "sgd", "learning_rate": 300.0, "lr_scheduler_type": "constant", "max_steps": 2}
    args = tiny_grpo_config(output_dir, **(values | family_overrides(kind) | overrides))
    peft = LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian") if lora else None
    trainer = DanceGRPOTrainer(
        model_dir, "brightness", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=peft
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    tflops = sum(entry.get("perf/denoiser_tflops", 0.0) for entry in trainer.state.log_history)
    return before, after, tflops, trainer


@pytest.mark.parametrize("case", list(CASES))
def test_rollout_backprop_takes_the_recomputed_update(tiny_model_dir, tmp_path, case):
    """Two rounds (the second rolls out from the updated weights): the trained parameters end within 1e-4 of their
    move from the standard path's, the round's loss is the same and starts on-policy (ratio 1), and the denoiser's
    TFLOPs drop by the training forwards (≤ 0.8× with LoRA)."""
    kind, overrides = CASES[case]
    lora = "full" not in case
    model_dir = tiny_model_dir(kind)
    start, standard, standard_tflops, _ = _train(model_dir, tmp_path / "a", kind, lora, **overrides)
    _, backprop, backprop_tflops, trainer = _train(
        model_dir, tmp_path / "b", kind, lora, rollout_backprop=True, **overrides
    )
    move = max((standard[n] - start[n]).abs().max().item() for n in start)
    off = max((backprop[n] - standard[n]).abs().max().item() for n in start)
    assert move > 1e-3, move  # the runs learn something to compare
    assert off <= 1e-4 * move, (off, move)
    # Exactly on-policy: the differentiated log-probability is the stored one (the standard path's ratio is 1 to
    # rounding: its loss, −mean(A·ρ) with group-centred A, is a residual of order 1e-5 that tells nothing here).
    assert [e["ratio/mean"] for e in trainer.state.log_history if "ratio/mean" in e] == [1.0, 1.0]
    if lora:  # the training forward is a third of a LoRA transition's cost (forward, its backward ≈ one forward)
        assert backprop_tflops <= 0.8 * standard_tflops, (backprop_tflops, standard_tflops)
    else:
        assert backprop_tflops < standard_tflops


def test_compiled_rollout_backprop_takes_the_eager_update(tiny_model_dir, tmp_path):
    """Compiled blocks with activation checkpointing: the second round's rollout calls them with gradients on a varying
    number of rows (2 of 5 steps drawn per sample), and the round's backward recomputes each call after calls of other
    sizes; the same graph must serve a call's forward and its recomputation (a static graph per row count would not:
    torch.utils.checkpoint's CheckpointError). The update is eager's."""
    overrides = {"activation_checkpointing": True, "timestep_fraction": 0.5, "gradient_accumulation_steps": 2}
    model_dir = tiny_model_dir("flux")
    start, eager, _, _ = _train(model_dir, tmp_path / "a", "flux", True, rollout_backprop=True, **overrides)
    compiled = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    _, fast, _, _ = _train(model_dir, tmp_path / "b", "flux", True, rollout_backprop=True, **compiled, **overrides)
    move = max((eager[n] - start[n]).abs().max().item() for n in start)
    off = max((fast[n] - eager[n]).abs().max().item() for n in start)
    assert move > 1e-3 and off <= 1e-4 * move, (off, move)


def test_rollout_backprop_refuses_what_it_cannot_take_exactly(tmp_path):
    values = tiny_grpo_config(tmp_path).to_dict() | {"rollout_backprop": True}
    values = {k: v for k, v in values.items() if k in DanceGRPOConfig.__dataclass_fields__ and not k.startswith("_")}
    base = {k: values[k] for k in ("output_dir", "use_cpu", "report_to", "num_generations", "generation_batch_size",
                                   "num_inference_steps", "per_device_train_batch_size", "timestep_fraction",
                                   "eta", "rollout_backprop")}  # fmt: skip
    assert DanceGRPOConfig(**base).gradient_accumulation_steps == 5  # one update per round by default
    assert DanceGRPOConfig(**base, num_iterations=2).gradient_accumulation_steps == 10  # both passes, one update
    refused = {
        "2 optimizer updates per round": {"num_iterations": 2, "gradient_accumulation_steps": 5},
        "5 optimizer updates per round": {"gradient_accumulation_steps": 1},
        "beta > 0": {"beta": 0.01},
        "ratio_normalization": {"ratio_normalization": True},
        "trust_region='dppo'": {"trust_region": "dppo"},
        "best_of_n_k": {"best_of_n_k": 1, "per_device_train_batch_size": 4},
        "a window per group": {"timestep_selection": "iso_temporal", "sde_window_size": 3},
    }
    for why, overrides in refused.items():
        with pytest.raises(ValueError, match=f"rollout_backprop is exact only .*{why}"):
            DanceGRPOConfig(**(base | overrides))


def test_rollout_backprop_on_two_processes_averages_as_ddp(tiny_model_dir, tmp_path):
    """Two CPU processes (gloo): the gradients of the round's backward, made outside DDP's forward, are averaged as
    DDP averages the standard path's; the LoRAs after two rounds agree to 1e-4 of their move."""
    script = os.path.join(ROOT, "tests", "rollout_backprop_run.py")
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
        script, tiny_model_dir("flux"), str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    runs = {name: torch.load(tmp_path / f"{name}.pt") for name in ("start", "standard", "backprop")}
    move = max((runs["standard"][n] - runs["start"][n]).abs().max().item() for n in runs["start"])
    off = max((runs["backprop"][n] - runs["standard"][n]).abs().max().item() for n in runs["start"])
    assert move > 1e-3 and off <= 1e-4 * move, (off, move)
