"""Online Diffusion-DPO (AI feedback): pair selection, ln 2 at initialisation, the margin mask, bad input, learning."""

import functools
import math

import pytest
import torch
from conftest import (
    LEARNING_SEED,
    LORA_TARGETS,
    PROMPTS,
    tiny_online_values,
    train_and_assert_reward_rose,
    train_and_resume,
)
from datasets import Dataset
from peft import LoraConfig

from trl_dance import OnlineDiffusionDPOConfig, OnlineDiffusionDPOTrainer
from trl_dance.ai_feedback import best_and_worst


def online_dpo_config(output_dir, **overrides) -> OnlineDiffusionDPOConfig:
    values = tiny_online_values(output_dir) | {
        "per_device_train_batch_size": 2,  # 2 prompts × 4 samples: 2 pairs per round, one micro-batch
        "beta": 500.0,
    }
    return OnlineDiffusionDPOConfig(**(values | overrides))


def _trainer(tiny_model_dir, tmp_path, kind="sd3", reward="brightness", **overrides):
    return OnlineDiffusionDPOTrainer(
        tiny_model_dir(kind),
        reward,
        args=online_dpo_config(tmp_path, **overrides),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS),
    )


def test_best_and_worst_by_hand():
    scores = torch.tensor([[0.1, 0.5, 0.3], [0.2, 0.2, 0.2], [0.0, -1.0, 0.05]])
    best, worst, keep = best_and_worst(scores)
    assert best.tolist() == [1, 0, 2] and worst.tolist() == [0, 0, 1] and keep.tolist() == [True, False, True]
    assert best_and_worst(scores, min_margin=0.5)[2].tolist() == [False, False, True]


def test_round_pairs_are_each_prompts_best_and_worst_and_loss_is_ln2(tiny_model_dir, tmp_path):
    """The chosen latent of a prompt is its highest-reward sample, the rejected its lowest (the brightness of the
    decoded chosen/rejected latents equals the round's max/min reward); at the LoRA's initialisation the policy is the
    reference: loss ln 2, implicit accuracy ½."""
    trainer = _trainer(tiny_model_dir, tmp_path)
    rows = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]
    inputs = trainer._prepare_inputs(rows)
    rewards = trainer._rollout["rewards"].view(2, 4)
    order = trainer._microbatches[0][0]  # the pairs of the micro-batch, in its order
    with torch.no_grad():
        brightness = trainer.policy.decode(inputs["latents"]).mean(dim=(1, 2, 3)).view(2, 2)
    torch.testing.assert_close(brightness[:, 0], rewards.max(dim=1).values[order], atol=1e-5, rtol=0)
    torch.testing.assert_close(brightness[:, 1], rewards.min(dim=1).values[order], atol=1e-5, rtol=0)
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, inputs)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert trainer._metrics["implicit_acc"] == [0.5] and trainer._metrics["pairs/kept"] == [1.0]


def test_pairs_below_the_margin_train_nothing(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, min_margin=10.0)  # brightness gaps are < 1
    inputs = trainer._prepare_inputs([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    trainer.compute_loss(trainer.model, inputs).backward()
    grads = [p.grad for p in trainer.model.parameters() if p.requires_grad]
    assert all(g is None or not g.any() for g in grads)
    assert trainer._metrics["pairs/kept"] == [0.0]


def test_bad_input(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="online Diffusion-DPO needs share_initial_noise='none'"):
        online_dpo_config(tmp_path, share_initial_noise="group")
    with pytest.raises(ValueError, match="min_margin must be >= 0"):
        online_dpo_config(tmp_path, min_margin=-1.0)
    with pytest.raises(ValueError, match="loss_type must be a list of"):
        online_dpo_config(tmp_path, loss_type=["kto"])
    with pytest.raises(ValueError, match="at least one reward function is required"):
        _trainer(tiny_model_dir, tmp_path, reward=[])


# Gains (first 3 → last 3 rounds, deterministic-sampler rollouts) over seeds 42, 1, 2 × 1 and 2 threads: 0.099-0.129
# (sample std <= 0.006); the margin 0.02 is the smallest gain / 4.9.
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "margin"), [("sd3", 0.02)])
def test_online_dpo_raises_a_known_reward(tiny_model_dir, tmp_path, kind, margin):
    args = online_dpo_config(
        tmp_path,
        generation_batch_size=32,  # 8 prompts × 4 samples: 8 pairs per round
        per_device_train_batch_size=8,
        num_iterations=2,
        max_steps=60,
        learning_rate=3e-2,
        seed=LEARNING_SEED,
    )
    trainer = OnlineDiffusionDPOTrainer(
        tiny_model_dir(kind),
        "brightness",
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS),
    )
    train_and_assert_reward_rose(trainer, "brightness", margin)


def test_resume_inside_a_round_is_exact(tiny_model_dir, tmp_path):
    """One pair a micro-batch and an update each (2 a round): resumed after the first, bit-identical."""
    train_and_resume(functools.partial(_trainer, tiny_model_dir), tmp_path / "run", per_device_train_batch_size=1)
