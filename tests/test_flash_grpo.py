"""Flash-GRPO (arXiv 2605.15980) as a DanceGRPO configuration: the Flash SDE in closed form, one SDE window per group
(iso-temporal grouping) that rolls out exactly what a round-wide window at the same place rolls out, per-group timestep
draws, and temporal gradient rectification putting every timestep's log-prob gradient on one scale."""

import pytest
import torch
from conftest import (
    LEARNING_SEED,
    LORA_TARGETS,
    PROMPTS,
    assert_learned,
    family_overrides,
    max_ratio_deviation,
    tiny_grpo_config,
)
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer
from trl_dance.sampling import RolloutPlan, generate, sample_generators
from trl_dance.sde import flow_sde_step

FLASH = {"sde_window_size": 1, "timestep_selection": "iso_temporal", "sde_type": "flash", "eta": 1.0}


def _trainer(tiny_model_dir, tmp_path, kind="flux", **overrides):
    overrides = {"gradient_accumulation_steps": None} | overrides  # the fewest updates per round that divide it
    args = tiny_grpo_config(tmp_path, **(family_overrides(kind) | overrides))
    return DanceGRPOTrainer(
        tiny_model_dir(kind),
        "brightness",
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights="gaussian"),
    )


def test_flash_sde_is_the_flow_sde_with_a_diffusion_linear_in_sigma():
    """s = η(σ_min + (σ_max − σ_min)σ); mean x − Δ(v + s²/(2σ)(x + (1 − σ)v)); std s√Δ; exact Gaussian log-density."""
    torch.manual_seed(0)
    v, x, noise = torch.randn(3, 2, 4, 5, 5).unbind(0)
    sigma, sigma_next, high, low, eta = torch.tensor([0.9, 0.4]), torch.tensor([0.8, 0.25]), 0.95, 0.02, 0.7
    out = flow_sde_step(v, x, sigma, sigma_next, sde_type="flash", eta=eta, sigma_max=high, sigma_min=low, noise=noise)
    s = (eta * (low + (high - low) * sigma)).view(2, 1, 1, 1)
    delta = (sigma - sigma_next).view(2, 1, 1, 1)
    mean = x - delta * (v + s**2 / (2 * sigma.view(2, 1, 1, 1)) * (x + (1 - sigma.view(2, 1, 1, 1)) * v))
    std = s * delta.sqrt()
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.std, std.flatten())
    density = torch.distributions.Normal(mean, std).log_prob(out.prev_sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, density)
    with pytest.raises(ValueError, match="needs sigma_max"):
        flow_sde_step(v, x, sigma, sigma_next, sde_type="flash", eta=eta)


def test_gradient_scale_matches_the_closed_form_and_autograd(tiny_model_dir, tmp_path):
    """g_t = Δ(1 + s²(1−σ)/(2σ))/(s√Δ); on-policy ∂log p/∂v = −g_t·ε/D (mean reduction over D elements)."""
    trainer = _trainer(tiny_model_dir, tmp_path, **FLASH)
    policy, steps = trainer.policy, trainer.policy.trainable_steps()
    sigmas = policy.process.sigmas
    sigma, delta = sigmas[steps], sigmas[steps] - sigmas[[i + 1 for i in steps]]
    s = sigmas[1] * sigma + sigmas[-1] * (1 - sigma)  # η = 1
    closed = delta * (1 + s**2 * (1 - sigma) / (2 * sigma)) / (s * delta.sqrt())
    torch.testing.assert_close(policy.process.log_prob_gradient_scale(steps), closed)
    index = torch.tensor(steps)
    latents, eps = torch.randn(2, len(steps), 4, 3, 3).unbind(0)
    output = torch.randn(len(steps), 4, 3, 3, requires_grad=True)
    mean = policy.step(output.detach(), latents, index, compute_log_prob=False).mean
    at = mean + policy.step(output.detach(), latents, index, compute_log_prob=False).std.view(-1, 1, 1, 1) * eps
    (grad,) = torch.autograd.grad(policy.step(output, latents, index, prev_sample=at).log_prob.sum(), output)
    torch.testing.assert_close(grad, -closed.view(-1, 1, 1, 1) * eps / eps[0].numel(), rtol=1e-4, atol=1e-7)


def test_rectification_puts_every_timestep_on_one_gradient_scale(tiny_model_dir, tmp_path):
    """On-policy transitions of the tiny FLUX with the same standard noise: the gradient of the rectified log-prob with
    respect to the network output has one norm at every timestep (without rectification it spans a factor > 2)."""
    trainer = _trainer(tiny_model_dir, tmp_path, temporal_rectification=True, sde_type="flash", eta=1.0)
    policy, steps = trainer.policy, trainer.policy.trainable_steps()
    cond = policy.encode_prompts(PROMPTS[:1] * len(steps))
    index = torch.tensor(steps)
    latents = torch.randn(len(steps), *policy.initial_noise([torch.Generator().manual_seed(0)]).shape[1:])
    output = policy.predict(trainer.model, latents, cond, at=index).detach().requires_grad_(True)
    first = policy.step(output.detach(), latents, index, compute_log_prob=False)
    eps = torch.randn(1, *latents.shape[1:]).expand_as(latents)
    at = first.mean + first.std.view(-1, *[1] * (latents.ndim - 1)) * eps
    log_prob = policy.step(output, latents, index, prev_sample=at).log_prob
    (raw,) = torch.autograd.grad(log_prob.sum(), output)
    norms = raw.flatten(1).norm(dim=1)
    rectified = norms * trainer._rectification[index]
    assert norms.max() / norms.min() > 2
    assert rectified.max() / rectified.min() < 1 + 1e-4, rectified
    assert trainer._rectification[index].mean().item() == pytest.approx(1.0)


def test_a_window_per_sample_rolls_out_what_a_shared_window_at_its_place_does(tiny_model_dir, tmp_path):
    """Each sample of a staggered plan has the latents and log-probs of a round-wide window at its own start (same
    noise), and an unstaggered one equals the round-wide rollout exactly."""
    trainer = _trainer(tiny_model_dir, tmp_path, sde_window_size=2)
    policy, n = trainer.policy, trainer.policy.num_steps
    cond = policy.encode_prompts(PROMPTS[:4])
    starts = [0, 3, 1, 3]

    def run(plan):
        return generate(policy, trainer.model, sample_generators(0, 0, 0, 4), cond, plan, keep_means=True)

    staggered = run(RolloutPlan.staggered(n, starts, 2))
    for start in set(starts):
        shared = run(RolloutPlan(n, start, start + 2))
        rows = [b for b, s in enumerate(starts) if s == start]
        for key in ("latents", "log_probs", "means", "final_latents"):
            torch.testing.assert_close(staggered[key][rows], shared[key][rows], rtol=0, atol=0)
    assert staggered["denoiser_calls"] == 4 * n


def test_iso_temporal_groups_share_their_window_and_steps_and_start_on_policy(tiny_model_dir, tmp_path):
    """Flash-GRPO's plan: a group's members share their SDE step, groups are placed independently (seeded by the
    global group, not the process), and the round's first update is on-policy (ratio 1)."""
    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        **FLASH,
        temporal_rectification=True,
        generation_batch_size=16,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
    )
    rows = [{"prompt": p} for p in PROMPTS[:4] for _ in range(4)]
    trainer._generate_and_score(rows)
    first_steps = trainer._rollout["first_step"].view(4, 4)
    assert (first_steps == first_steps[:, :1]).all()
    starts = [trainer.sde_window.group_start(0, trainer.args.seed, group) for group in range(64)]
    assert len(set(starts)) == trainer.sde_window.positions  # every position is drawn across groups
    trained = sorted((int(s), int(t)) for sample, step in trainer._microbatches for s, t in zip(sample, step))
    assert [t for _, t in trained] == first_steps.flatten().tolist()  # each sample trains its one SDE step
    assert max_ratio_deviation(trainer, grad=True) < 1e-6


def test_per_group_windows_do_not_depend_on_how_samples_are_split_over_processes(tiny_model_dir, tmp_path):
    """Two processes holding 4 samples each get the windows one process holding all 8 gets (seeded by the global
    group), and a group split across the two keeps one window."""
    trainer = _trainer(tiny_model_dir, tmp_path, **FLASH, num_generations=4)
    plan = trainer.rollout_plan()
    whole = trainer._sample_plan(plan, 0, 8, 0).sample_starts
    halves = trainer._sample_plan(plan, 0, 4, 0).sample_starts + trainer._sample_plan(plan, 4, 4, 0).sample_starts
    assert whole == halves
    odd = trainer._sample_plan(plan, 2, 4, 0).sample_starts  # samples 2-5: groups 0 and 1
    assert odd == whole[2:6] and odd[0] == odd[1] and odd[2] == odd[3]


def test_iso_temporal_draws_without_a_window_are_per_group(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, timestep_selection="iso_temporal", timestep_fraction=0.4)
    trainer._generate_and_score([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    by_sample = {}
    for sample, step in trainer._microbatches:
        for s, t in zip(sample.tolist(), step.tolist()):
            by_sample.setdefault(s, set()).add(t)
    assert all(len(steps) == 2 for steps in by_sample.values())
    for group in (range(4), range(4, 8)):
        assert len({frozenset(by_sample[s]) for s in group}) == 1


def test_flash_configurations_are_checked(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="excludes branching"):
        tiny_grpo_config(tmp_path, **FLASH, branching=True, share_initial_noise="group")
    with pytest.raises(ValueError, match="excludes sde_window_schedule='progressive'"):
        tiny_grpo_config(tmp_path, **FLASH, sde_window_schedule="progressive")
    with pytest.raises(ValueError, match="temporal_rectification divides out"):
        tiny_grpo_config(tmp_path, temporal_rectification=True, sde_type="cps")
    with pytest.raises(ValueError, match="sde_type='flash' is a rectified-flow SDE"):
        _trainer(tiny_model_dir, tmp_path, kind="sd", sde_type="flash")


# Flash-GRPO scaled to the tiny models: one SDE step per sample in the first half of 8 steps, placed per group, the
# Flash SDE at η 1, rectified; 32 samples (8 groups) per round, one update per round, 30 rounds. Wan: CFG 5 and the
# whole-video temporal consistency (the random Wan VAE leaves brightness nearly fixed; see test_video.py). Gains over
# seeds (one thread): SD3 +0.149 / +0.155 (seeds 1, 2; std ≤ 0.0065), Wan +0.0087 / +0.0077 / +0.0090 (seeds 42, 1, 2;
# std ≤ 0.0020); each margin is below the smallest gain / 3.
FLASH_LEARNING = {
    "sd3": ("brightness", {"learning_rate": 3e-2}, 0.02),
    "wan": (
        "temporal_consistency",
        {"learning_rate": 1.5e-2, "lr_scheduler_type": "constant", "guidance_scale": 5.0},
        0.002,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(FLASH_LEARNING))
def test_flash_grpo_learns(tiny_model_dir, tmp_path, kind):
    reward, settings, margin = FLASH_LEARNING[kind]
    values = {"generation_batch_size": 32, "num_inference_steps": 8, "sde_window_range": [0, 4], "max_steps": 30}
    values |= {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2, "seed": LEARNING_SEED}
    values |= {"temporal_rectification": True} | FLASH | settings
    args = tiny_grpo_config(tmp_path, **(family_overrides(kind) | values))
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS)
    trainer = DanceGRPOTrainer(
        tiny_model_dir(kind), reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [h["reward"] for h in history]
    print(f"{kind}: per round {rewards}")
    assert_learned(reward, sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3, history[0]["reward_std"], margin)
