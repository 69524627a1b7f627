"""EMA of the trained parameters: evaluation with it, ema/ beside every save, exact resume."""

import pytest
import torch
from conftest import LORA_TARGETS, PROMPTS, tiny_grpo_config
from datasets import Dataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from safetensors.torch import load_file

from trl_dance import DanceGRPOTrainer


def _trainer(tiny_model_dir, output_dir, **overrides):
    args = tiny_grpo_config(output_dir, use_ema=True, ema_decay=0.5, learning_rate=1e-2, **overrides)
    return DanceGRPOTrainer(
        tiny_model_dir("flux"),
        "brightness",
        args,
        Dataset.from_dict({"prompt": PROMPTS[:8]}),
        Dataset.from_dict({"prompt": ["a blue car", "a small boat"]}),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS),
    )


def test_ema_is_evaluated_and_saved(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, max_steps=3)
    trainer.train()
    shadow = trainer.ema.ema.shadow_params
    trained = trainer.ema.params
    assert all(s.shape == p.shape for s, p in zip(shadow, trained))
    assert any(not torch.equal(s, p) for s, p in zip(shadow, trained))  # an average, not the last weights
    with_ema = trainer.evaluate()["eval_reward"]
    ema, trainer.ema = trainer.ema, None
    without = trainer.evaluate()["eval_reward"]
    with ema.applied():
        assert trainer.evaluate()["eval_reward"] == with_ema  # evaluate() samples with the EMA weights
    trainer.ema = ema
    assert with_ema != without
    assert all(torch.equal(p, q) for p, q in zip(trainer.ema.params, trained))  # restored after use

    trainer.save_model()
    saved, averaged = (load_file(tmp_path / d / "pytorch_lora_weights.safetensors") for d in (".", "ema"))
    assert saved.keys() == averaged.keys()
    assert any(not torch.equal(saved[k], averaged[k]) for k in saved)
    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dir("flux"))
    pipeline.load_lora_weights(str(tmp_path / "ema"))  # diffusers reads the EMA too


def test_resume_restores_the_ema(tiny_model_dir, tmp_path):
    overrides = {"max_steps": 3, "save_strategy": "steps", "save_steps": 1}
    full = _trainer(tiny_model_dir, tmp_path / "run", **overrides)
    full.train()
    resumed = _trainer(tiny_model_dir, tmp_path / "run", **overrides)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    for a, b in zip(full.ema.ema.shadow_params, resumed.ema.ema.shadow_params):
        assert torch.equal(a, b)
    assert resumed.ema.ema.optimization_step == full.ema.ema.optimization_step == 3


def test_bad_ema_decay(tmp_path):
    with pytest.raises(ValueError, match="ema_decay must be in"):
        tiny_grpo_config(tmp_path, use_ema=True, ema_decay=1.0)
