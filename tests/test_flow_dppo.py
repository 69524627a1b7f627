"""Flow-DPPO's trust region (DanceGRPOConfig(trust_region="dppo")): the mask's truth table, on-policy equality with
the policy gradient, and the mask engaging over several updates of one round."""

import pytest
import torch
from conftest import LORA_TARGETS, PROMPTS, tiny_grpo_config
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer
from trl_dance.losses import clipped_surrogate, dppo_surrogate


def test_mask_stops_only_updates_that_left_the_region_the_advantages_way():
    ratio = torch.tensor([1.2, 0.8, 1.2, 0.8, 1.2, 0.8])
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    kl = torch.tensor([1e-5, 1e-5, 1e-5, 1e-5, 1e-7, 1e-7])
    loss, keep = dppo_surrogate(ratio, advantages, kl, 1e-6)
    assert keep.tolist() == [0, 0, 1, 1, 1, 1]  # outside and further: stopped; back toward the old policy, or inside
    torch.testing.assert_close(loss, -advantages * ratio * keep)
    # At the old policy (ρ = 1, KL = 0) it is the policy gradient, as PPO's clip is: the same value and gradient.
    ratio = torch.ones(4, requires_grad=True)
    advantages = torch.tensor([1.0, -2.0, 0.5, 0.0])
    dppo, _ = dppo_surrogate(ratio, advantages, torch.zeros(4), 1e-6)
    (grad,) = torch.autograd.grad(dppo.sum(), ratio)
    (clip_grad,) = torch.autograd.grad(clipped_surrogate(ratio, advantages, 1e-4).sum(), ratio)
    assert torch.equal(grad, clip_grad) and torch.equal(grad, -advantages)


def test_dppo_trains_on_policy_first_then_masks_within_the_round(tiny_model_dir, tmp_path):
    """Five optimizer updates per round: the first is on-policy (KL below 1e-9, nothing masked), later ones move
    away from the rollout policy, and the loss stops the transitions whose KL passed τ the advantage's way."""
    args = tiny_grpo_config(
        tmp_path, trust_region="dppo", dppo_kl_threshold=1e-6, gradient_accumulation_steps=1, max_steps=5
    )
    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"),
        "brightness",
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "dppo/kl" in entry]
    assert len(logs) == 5
    assert logs[0]["dppo/kl"] < 1e-9 and logs[0]["dppo/masked_fraction"] == 0
    assert max(entry["dppo/kl"] for entry in logs[1:]) > 1e-6
    assert max(entry["dppo/masked_fraction"] for entry in logs[1:]) > 0


def test_dppo_with_one_update_per_round_says_it_does_nothing(tmp_path):
    with pytest.warns(UserWarning, match="one optimizer update per round: .* its mask never acts"):
        tiny_grpo_config(tmp_path, trust_region="dppo")  # 5 micro-batches, one update
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny_grpo_config(tmp_path, trust_region="dppo", gradient_accumulation_steps=1)  # 5 updates: no warning


def test_dppo_threshold_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="dppo_kl_threshold must be a positive number"):
        tiny_grpo_config(tmp_path, trust_region="dppo", dppo_kl_threshold=0.0)
    with pytest.raises(ValueError, match="trust_region must be one of"):
        tiny_grpo_config(tmp_path, trust_region="kl")


def test_v_space_kl_is_the_output_mse_from_the_stored_means(tiny_model_dir, tmp_path):
    """dppo_kl_space='v': 2·KL/g_t² of two steps' Gaussians equals mean((v_θ − v_old)²) of their network outputs
    (Flow-Factory's v-based mask) at every trainable step, and a run with it starts on-policy (KL 0, nothing masked)."""
    from trl_dance.losses import gaussian_step_kl

    args = tiny_grpo_config(
        tmp_path, trust_region="dppo", dppo_kl_space="v", gradient_accumulation_steps=1, max_steps=2
    )
    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"), "brightness", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS),
    )  # fmt: skip
    policy, steps = trainer.policy, torch.tensor(trainer.policy.trainable_steps())
    torch.manual_seed(0)
    latents, new, old = torch.randn(3, len(steps), 4, 3, 3).unbind(0)
    new_step = policy.step(new, latents, steps, compute_log_prob=False)
    old_step = policy.step(old, latents, steps, compute_log_prob=False)
    kl = gaussian_step_kl(new_step.mean, old_step.mean, new_step.std)
    v_space = 2 * kl / trainer._gradient_scale[steps] ** 2
    torch.testing.assert_close(v_space, ((new - old) ** 2).mean(dim=(1, 2, 3)), rtol=1e-5, atol=1e-7)
    trainer.train()
    first = next(entry for entry in trainer.state.log_history if "dppo/kl" in entry)
    assert first["dppo/kl"] < 1e-9 and first["dppo/masked_fraction"] == 0
    with pytest.raises(ValueError, match="dppo_kl_space must be one of"):
        tiny_grpo_config(tmp_path, trust_region="dppo", dppo_kl_space="z")
