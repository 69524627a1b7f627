"""DeepSpeed ZeRO-2 and ZeRO-3 with two real CPU processes, through the shipped accelerate configs."""

import json
import os
import subprocess
import sys

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from trl_dance.testing import TINY_VIDEO_FRAMES

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "distributed_run.py")


def _launch(stage, trainer, mode, model_dir, tmp_path, port, overrides):
    output_dir, result = tmp_path / "out", tmp_path / "result.json"
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(ROOT, "trl_dance", "accelerate_configs", f"zero{stage}.yaml"),
        "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(port),
        SCRIPT, trainer, mode, model_dir, str(output_dir), str(result), json.dumps(overrides),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with open(result) as handle:
        return output_dir, json.load(handle)


# Wan 2.2 A14B's low-noise expert trained under ZeRO-3 (sharded), the high-noise one frozen in bf16 beside the engine.
LOW_NOISE_EXPERT = {
    "num_frames": TINY_VIDEO_FRAMES,
    "num_inference_steps": 6,
    "train_expert": "low_noise",
    "timestep_fraction": 0.6,
    "guidance_scale": 4.0,
    "guidance_scale_2": 3.0,
    "frozen_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("stage", "trainer", "mode", "kind", "overrides"),
    [
        (2, "grpo", "lora", "flux", {}),
        (2, "dpo", "full", "sd", {}),
        (2, "nft", "lora", "flux", {}),
        (2, "nft", "full", "flux", {"loss_type": "awm"}),
        (2, "direct", "lora", "flux", {}),
        (3, "grpo", "full", "flux", {}),
        (3, "dpo", "lora", "sd", {}),
        (3, "grpo", "lora", "wan22", LOW_NOISE_EXPERT),
    ],
)
def test_zero_trains_and_saves_a_complete_model(tiny_model_dir, tmp_path, stage, trainer, mode, kind, overrides):
    model_dir = tiny_model_dir(kind)
    port = 29600 + 10 * stage + len(trainer + mode + kind)
    output_dir, result = _launch(stage, trainer, mode, model_dir, tmp_path, port, overrides)
    assert result["num_processes"] == 2 and result["zero_stage"] == stage
    assert "DEEPSPEED" in result["distributed_type"]
    assert result["partitioned"] == (stage == 3)  # ZeRO-3 really sharded the parameters
    assert result["losses"] and all(torch.isfinite(torch.tensor(result["losses"])))

    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    denoiser_name = {"flux": "transformer", "sd": "unet", "wan22": "transformer_2"}[kind]
    base = getattr(pipeline, denoiser_name).state_dict()
    if mode == "lora":
        saved = load_file(output_dir / "pytorch_lora_weights.safetensors")
        lora_b = [key for key in saved if "lora_B" in key]
        # One A and one B per targeted Linear: to_q/k/v/out.0 of every attention block of the denoiser.
        targets = [k for k in base if k.endswith(("to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight"))]
        assert len(lora_b) == len(targets) and len(saved) == 2 * len(targets)
        assert all(saved[key].numel() > 0 and saved[key].abs().sum() > 0 for key in lora_b)  # trained, not empty
        # and diffusers reads it, into the trained expert
        pipeline.load_lora_weights(str(output_dir), **({"load_into_transformer_2": True} if kind == "wan22" else {}))
        assert getattr(getattr(pipeline, denoiser_name), "_hf_peft_config_loaded", False)
    else:
        trained = type(getattr(pipeline, denoiser_name)).from_pretrained(str(output_dir)).state_dict()
        assert trained.keys() == base.keys()
        assert all(trained[k].shape == base[k].shape for k in base)
        assert any(not torch.equal(trained[k], base[k]) for k in base)  # the trained weights, gathered
