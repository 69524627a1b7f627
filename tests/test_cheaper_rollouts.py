"""SDE windows (Flow-GRPO-Fast, MixGRPO), MixGRPO-Flash, branching, GRPO-Guard, best-of-N, GDPO aggregation."""

import copy
import re

import pytest
import torch
from conftest import (
    LEARNING_SEED,
    LORA_TARGETS,
    PROMPTS,
    assert_learned,
    family_overrides,
    max_ratio_deviation,
    recomputed_steps,
    tiny_grpo_config,
    tiny_online_values,
)
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer
from trl_dance.advantages import extremes_per_group, normalized_reward_sum
from trl_dance.losses import normalized_log_ratio
from trl_dance.sampling import RolloutPlan, SDEWindow, compressed_steps, solve
from trl_dance.sde import flow_sde_step

ROWS = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]


def _trainer(tiny_model_dir, tmp_path, kind="flux", lora=True, **overrides):
    # 8 samples × W window steps / 8 per micro-batch: W micro-batches per round (5 without a window).
    overrides.setdefault("gradient_accumulation_steps", overrides.get("sde_window_size", 5))
    args = tiny_grpo_config(tmp_path, **{**family_overrides(kind), **overrides})
    peft = LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian") if lora else None
    return DanceGRPOTrainer(
        tiny_model_dir(kind),
        "brightness",
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
        peft_config=peft,
    )


def _sample(trainer, plan, groups=None, count=8):
    generators = [torch.Generator().manual_seed(i) for i in range(count)]
    noise = trainer._initial_noise(generators, 0)  # shared within groups of 4
    prompts = [row["prompt"] for row in ROWS[:count]]  # groups of 4 share prompt and initial noise
    return trainer.sample(prompts, generators, initial_noise=noise, plan=plan, groups=groups)


def test_window_covering_every_step_is_todays_sampler(tiny_model_dir, tmp_path):
    """A window over all N − 1 trainable steps is the plan without a window: bit-identical rollouts and the same
    transitions (the previous sampler's rollouts were also checked bit-identical for FLUX, SD1.5, SD3 and Wan)."""
    plain = _trainer(tiny_model_dir, tmp_path)
    windowed = _trainer(tiny_model_dir, tmp_path, sde_window_size=5)
    assert windowed.rollout_plan() == plain.rollout_plan() == RolloutPlan(6)
    for trainer in (plain, windowed):
        trainer._generate_and_score(ROWS)
    for key in ("latents", "log_probs", "images", "advantages"):
        assert torch.equal(plain._rollout[key], windowed._rollout[key]), key
    assert [(s.tolist(), t.tolist()) for s, t in plain._microbatches] == [
        (s.tolist(), t.tolist()) for s, t in windowed._microbatches
    ]


@pytest.mark.parametrize(
    ("kind", "guidance"), [("flux", 3.5), ("sd3", 4.0), ("sd", 5.0), ("wan", 5.0), ("wan22", 5.0)]
)
def test_window_transitions_are_on_policy(tiny_model_dir, tmp_path, kind, guidance):
    """Only the window's W transitions are stored and trained, and each has ratio 1 on-policy."""
    extra = {"train_expert": "low_noise"} if kind == "wan22" else {}
    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        kind,
        sde_window_size=2,
        guidance_scale=guidance,
        gradient_accumulation_steps=2,
        **extra,
    )
    trainable = trainer.policy.trainable_steps()
    for _ in range(3):
        plan = trainer.rollout_plan()
        trainer._generate_and_score(ROWS)
        assert plan.sde_end - plan.sde_start == 2 and set(plan.stored_steps) <= set(trainable)
        assert trainer._rollout["latents"].shape[1] == 3 and trainer._rollout["log_probs"].shape[1] == 2
        steps = torch.cat([step for _, step in trainer._microbatches])
        assert sorted(steps.unique().tolist()) == list(plan.stored_steps)
        assert max_ratio_deviation(trainer) < 1e-5


@pytest.mark.parametrize("kind", ["flux", "sd"])
def test_steps_outside_the_window_are_the_schedulers_deterministic_steps(tiny_model_dir, tmp_path, kind):
    """The prefix before the window is the shipped scheduler's own deterministic step, called through diffusers:
    FlowMatchEulerDiscreteScheduler.step on the pipeline's σ grid, DDIMScheduler.step with η = 0."""
    trainer = _trainer(
        tiny_model_dir, tmp_path, kind, sde_window_size=2, sigma_schedule="pipeline", guidance_scale=1.0
    )
    policy, plan = trainer.policy, RolloutPlan(6, 3, 5)
    result = _sample(trainer, plan, count=2)
    if kind == "flux":
        scheduler = copy.deepcopy(policy.pipeline.scheduler)
        scheduler.set_timesteps(6, **policy._scheduler_kwargs())
    else:
        scheduler = copy.deepcopy(policy.process.scheduler)
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    x = trainer._initial_noise(generators, 0)
    cond = policy.encode_prompts([ROWS[0]["prompt"]] * 2)
    for i, t in enumerate(scheduler.timesteps):
        with torch.no_grad():
            output = policy.predict(trainer.model, x, cond, at=torch.full((2,), i))
        x = scheduler.step(output, t, x, **({"eta": 0.0} if kind == "sd" else {})).prev_sample
        if i == 2:
            torch.testing.assert_close(result["latents"][:, 0], x, rtol=1e-5, atol=1e-5)
    # A deterministic plan (evaluation, forward-process methods) is the scheduler's sampler all the way.
    ode = _sample(trainer, RolloutPlan.deterministic(6), count=2)
    assert ode["latents"].shape[1] == 0 and ode["log_probs"].shape == (2, 0)
    torch.testing.assert_close(ode["final_latents"], x, rtol=1e-5, atol=1e-5)


def test_branching_equals_unbranched_sampling_and_saves_calls(tiny_model_dir, tmp_path):
    """The group's prefix is computed once per group; the rollout is the unbranched one (float rounding aside)."""
    trainer = _trainer(tiny_model_dir, tmp_path, sde_window_size=2, branching=True, share_initial_noise="group")
    plan = RolloutPlan(6, 3, 5)
    groups = [i // 4 for i in range(8)]
    branched, plain = _sample(trainer, plan, groups), _sample(trainer, plan)
    for key in ("latents", "log_probs", "final_latents", "images"):
        torch.testing.assert_close(branched[key], plain[key], rtol=1e-5, atol=1e-5)
    assert plain["denoiser_calls"] == 8 * 6 and branched["denoiser_calls"] == 2 * 3 + 8 * 3
    # The window's noise differs within a group: the samples of a group part from the window on.
    assert torch.equal(branched["latents"][0, 0], branched["latents"][1, 0])
    assert not torch.equal(branched["latents"][0, 1], branched["latents"][1, 1])


def test_flash_grid_and_solver(tiny_model_dir, tmp_path):
    """MixGRPO-Flash: after the window, ⌊0.4 · remaining⌋ steps on the shifted linspace to 0, solved with
    DPM-Solver++(2M) from the last window state, its first step second order from the last window step's x̂0 (as
    MixGRPO's solver continues), which a first-order start does not reproduce."""
    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        num_inference_steps=12,
        sde_window_size=2,
        sde_window_range=[0, 4],
        sde_window_schedule="progressive",
        post_window_solver="dpm_solver++",
        post_window_step_ratio=0.4,
        gradient_accumulation_steps=2,
    )
    policy = trainer.policy
    torch.testing.assert_close(policy.process.sigma_at(torch.arange(13.0)), policy.process.sigmas)
    plan = trainer.rollout_plan(0)
    assert (plan.sde_start, plan.sde_end) == (0, 2) and compressed_steps(10, 0.4) == 4
    assert len(plan.post_window_sigmas) == 5 and plan.post_window_sigmas[-1] == 0
    torch.testing.assert_close(torch.tensor(plan.post_window_sigmas[0]), policy.process.sigmas[2])
    result = _sample(trainer, plan, count=2)
    assert result["denoiser_calls"] == 2 * (2 + 4)
    cond = policy.encode_prompts([ROWS[0]["prompt"]] * 2)
    with torch.no_grad():
        before, index = result["latents"][:, -2], torch.full((2,), plan.sde_end - 1)
        x0_hat = policy.process.predicted_clean(policy.predict(trainer.model, before, cond, at=index), before, index)
        previous = (x0_hat, policy.process.sigma_values[plan.sde_end - 1])
        last = result["latents"][:, -1]
        again = solve(policy, trainer.model, last, cond, plan.post_window_sigmas, "dpm_solver++", previous)
        first_order = solve(policy, trainer.model, last, cond, plan.post_window_sigmas, "dpm_solver++")
    torch.testing.assert_close(result["final_latents"], again, rtol=1e-5, atol=1e-5)
    assert (result["final_latents"] - first_order).abs().max() > 1e-4
    trainer._generate_and_score(ROWS)
    assert max_ratio_deviation(trainer) < 1e-5
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "SDE window: 2 steps in [0, 4), progressive; after it dpm_solver++ on 40% of the steps" in card


def test_window_schedules():
    progressive = SDEWindow(3, 1, 8, "progressive", stride=2, every=3)
    starts = [progressive.start(r, seed=0) for r in range(15)]
    # 5 positions (1..5); the start advances by 2 every 3 rounds and wraps.
    assert starts == [1, 1, 1, 3, 3, 3, 5, 5, 5, 2, 2, 2, 4, 4, 4]
    random = SDEWindow(2, 0, 5, "random")
    draws = [random.start(r, seed=7) for r in range(200)]
    assert set(draws) == {0, 1, 2, 3} and draws == [random.start(r, seed=7) for r in range(200)]
    assert draws != [random.start(r, seed=8) for r in range(200)]


def test_progressive_window_resumes_exactly(tiny_model_dir, tmp_path):
    """The window start follows the round counter, which checkpoints restore: an interrupted run continues the
    schedule and ends with the uninterrupted run's weights."""
    overrides = {
        "sde_window_size": 2,
        "sde_window_schedule": "progressive",
        "sde_window_stride_rounds": 1,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "save_strategy": "steps",
        "save_steps": 1,
    }
    full = _trainer(tiny_model_dir, tmp_path / "full", **overrides)
    full.train()
    starts = [h["sde_window/start"] for h in full.state.log_history if "sde_window/start" in h]
    assert starts == [0.0, 1.0, 2.0]
    resumed = _trainer(tiny_model_dir, tmp_path / "full", **overrides)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    assert [h["sde_window/start"] for h in resumed.state.log_history if "sde_window/start" in h][-2:] == [1.0, 2.0]
    for (name, value), other in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(value, other), name


def test_ratio_normalization_closed_form():
    """GRPO-Guard: s·(ℓ − ℓ_old + R(Δμ²)/(2s²)) = R(z·Δμ) for x = μ_old + s·z, 0 at μ = μ_old."""
    g = torch.Generator().manual_seed(0)
    v_old, x, v = (torch.randn(3, 4, 5, generator=g) for _ in range(3))
    v_new = v_old + 0.05 * v
    sigma, sigma_next = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.4, 0.1])
    for reduction in ("mean", "sum"):
        kwargs = {"sde_type": "flow_grpo", "eta": 0.7, "reduction": reduction}
        old = flow_sde_step(v_old, x, sigma, sigma_next, generator=g, **kwargs)
        new = flow_sde_step(v_new, x, sigma, sigma_next, prev_sample=old.prev_sample, **kwargs)
        at_old_mean = flow_sde_step(v_new, x, sigma, sigma_next, prev_sample=old.mean, **kwargs).log_prob
        at_mean = flow_sde_step(v_new, x, sigma, sigma_next, prev_sample=new.mean, **kwargs).log_prob
        ratio = normalized_log_ratio(new.log_prob, old.log_prob, at_old_mean, at_mean, new.std)
        z = (old.prev_sample - old.mean) / old.std.view(-1, 1, 1)
        product = z * (new.mean - old.mean)
        expected = product.mean(dim=(1, 2)) if reduction == "mean" else product.sum(dim=(1, 2))
        torch.testing.assert_close(ratio, expected, rtol=1e-4, atol=1e-6)
        # The plain log-ratio carries the downward bias −R(Δμ²)/(2s²) and the 1/s factor.
        torch.testing.assert_close(new.log_prob - old.log_prob, expected / new.std - (at_mean - at_old_mean))
        same = normalized_log_ratio(old.log_prob, old.log_prob, old.log_prob * 0 + at_mean, at_mean, new.std)
        assert torch.equal(same, torch.zeros(3))


def test_guard_training_is_on_policy(tiny_model_dir, tmp_path):
    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        sde_type="flow_grpo",
        eta=0.7,
        sde_window_size=3,
        ratio_normalization=True,
        step_reweighting=True,
        epsilon_high=2e-4,
        gradient_accumulation_steps=3,
    )
    trainer._generate_and_score(ROWS)
    assert trainer._rollout["means"].shape == trainer._rollout["latents"][:, 1:].shape
    for inputs, output, step in recomputed_steps(trainer):
        with torch.no_grad():
            assert trainer._normalized_log_ratio(output, inputs, step).abs().max() < 1e-6
        trainer.compute_loss(trainer.model, inputs).backward()


def test_normalize_then_sum_and_best_of_n():
    rewards = torch.tensor([[1.0, 10.0], [2.0, 30.0], [3.0, 20.0], [0.0, 0.0], [5.0, 1.0], [5.0, 3.0]])
    weights = torch.tensor([1.0, 0.5])
    advantages = normalized_reward_sum(rewards, weights, num_generations=3, clip=None)
    grouped = rewards.view(2, 3, 2)
    per_reward = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    total = (per_reward * weights).sum(-1).flatten()
    torch.testing.assert_close(advantages, (total - total.mean()) / (total.std() + 1e-4))
    assert extremes_per_group(torch.tensor([0.3, -1.0, 2.0, 0.1, 0.5, -0.2, 0.0, 9.0]), 4, 1).tolist() == [1, 2, 5, 7]


def test_best_of_n_and_timestep_selection_plan_the_round(tiny_model_dir, tmp_path):
    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        best_of_n_k=1,
        timestep_fraction=0.4,
        timestep_selection="last",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
    )
    trainer._generate_and_score(ROWS)
    samples = torch.cat([s for s, _ in trainer._microbatches])
    steps = torch.cat([t for _, t in trainer._microbatches])
    advantages = trainer._rollout["advantages"]
    expected = [int(advantages[:4].argmin()), int(advantages[:4].argmax())]
    expected += [4 + int(advantages[4:].argmin()), 4 + int(advantages[4:].argmax())]
    assert sorted(samples.unique().tolist()) == sorted(expected)
    assert sorted(steps.unique().tolist()) == [3, 4]  # the last 40 % of the 5 trainable steps


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sde_window_size": 6}, "sde_window_size must be in [1, 5]"),
        ({"sde_window_size": 3, "sde_window_range": [3, 5]}, "sde_window_range [3, 5)"),
        ({"sde_window_size": 2, "sde_window_range": [0, 6]}, "sde_window_range [0, 6)"),
        ({"sde_window_range": [0, 2]}, "sde_window_range needs sde_window_size"),
        ({"branching": True}, "branching applies to SDE-window rollouts"),
        ({"sde_window_size": 2, "branching": True, "share_initial_noise": "none"}, "share_initial_noise='group'"),
        ({"post_window_solver": "dpm_solver++"}, "post_window_solver='dpm_solver++' applies"),
        ({"sde_window_size": 2, "post_window_step_ratio": 0}, "post_window_step_ratio must be in (0, 1]"),
        ({"sde_window_size": 2, "last_step_sde": True}, "last_step_sde=True with sde_window_size"),
        ({"best_of_n_k": 3}, "best_of_n_k=3 trains 2k samples"),
        ({"best_of_n_k": 1, "per_device_train_batch_size": 4}, None),
        ({"ratio_normalization": True, "sde_type": "cps"}, "ratio_normalization needs a Gaussian"),
        ({"epsilon_high": 0.0}, "epsilon_high must be > 0"),
        ({"sde_window_schedule": "sliding"}, "sde_window_schedule must be one of"),
        ({"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "per_prompt"}, "per_prompt"),
    ],
)
def test_bad_cheaper_rollout_settings_fail_at_construction(tmp_path, overrides, message):
    if message is None:  # a valid setting: 2 groups of 4, 1 + 1 of each trained, 5 steps each
        assert tiny_grpo_config(tmp_path, gradient_accumulation_steps=1, **overrides).steps_per_generation == 5
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_grpo_config(tmp_path, **overrides)


def test_model_dependent_settings_fail_at_construction(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="flow-matching models only"):
        _trainer(tiny_model_dir, tmp_path, "sd", sde_window_size=2, post_window_solver="dpm_solver++")
    with pytest.raises(ValueError, match="step_reweighting"):
        _trainer(tiny_model_dir, tmp_path, "sd", step_reweighting=True)
    # Wan 2.2's low-noise expert serves only the late steps: a window range over early steps is refused.
    with pytest.raises(ValueError, match="must lie within the trainable steps"):
        _trainer(
            tiny_model_dir, tmp_path, "wan22", train_expert="low_noise", sde_window_size=1, sde_window_range=[0, 1]
        )


def _redness(prompts, images, **_):
    return images[:, 0].mean(dim=(1, 2)).tolist()


# One configuration per family of new modes, each a published recipe scaled to the tiny FLUX (N = 8 steps, 32 samples
# per round, one update per round, 30 rounds). Gains over seeds 42, 1, 2 and 1 or 2 threads (learning_spread.py):
# Fast + branching + Guard 0.164-0.193, MixGRPO-Flash + GDPO 0.321-0.376, best-of-N 0.051-0.139; each margin is at
# most the smallest gain / 2.5.
LEARNING_MODES = {
    # Flow-GRPO-Fast with branching and GRPO-Guard: a random 2-step window in the first half, asymmetric clip.
    "fast_branching_guard": (
        {"sde_type": "flow_grpo", "eta": 0.7, "sde_window_size": 2, "sde_window_range": [0, 4], "branching": True}
        | {"ratio_normalization": True, "step_reweighting": True, "epsilon_high": 2e-4},
        ["brightness"],
        0.06,
    ),
    # MixGRPO-Flash: a progressive 3-step window, DPM-Solver++ on 40 % of the remaining steps, GDPO aggregation.
    "mixgrpo_flash_gdpo": (
        {"sde_type": "flow_grpo", "eta": 0.7, "sde_window_size": 3, "sde_window_schedule": "progressive"}
        | {"sde_window_stride_rounds": 5, "post_window_solver": "dpm_solver++", "post_window_step_ratio": 0.4}
        | {"multi_objective_aggregation": "normalize_then_sum"},
        ["brightness", _redness],
        0.12,
    ),
    # DanceGRPO's best-of-N (1 + 1 of each group of 4) on the first 3 of the 7 trainable steps.
    "best_of_n_first_steps": (
        {"eta": 1.0, "best_of_n_k": 1, "timestep_selection": "first", "timestep_fraction": 0.43},
        ["brightness"],
        0.02,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(LEARNING_MODES))
def test_cheaper_modes_learn(tiny_model_dir, tmp_path, mode):
    """Learning: each new mode raises the reward (the sum of the rewards) well above its sample std."""
    settings, rewards, margin = LEARNING_MODES[mode]
    values = {"generation_batch_size": 32, "num_inference_steps": 8, "max_steps": 30, "seed": LEARNING_SEED}
    values |= {"per_device_train_batch_size": 16, "learning_rate": 3e-2} | settings
    probe = tiny_grpo_config(
        tmp_path, **(values | {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1})
    )
    transitions = probe.per_device_trained_samples * probe.timesteps_per_sample
    values["per_device_train_batch_size"] = max(d for d in range(1, 17) if transitions % d == 0)
    values["gradient_accumulation_steps"] = transitions // values["per_device_train_batch_size"]
    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"),
        rewards,
        args=tiny_grpo_config(tmp_path, **values),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS),
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    totals = [sum(h[f"rewards/{name}/mean"] for name in trainer.reward_names) for h in history]
    first, last = sum(totals[:3]) / 3, sum(totals[-3:]) / 3
    noise = max(history[0][f"rewards/{name}/std"] for name in trainer.reward_names)
    print(f"{mode}: per round {totals}")
    assert_learned("+".join(trainer.reward_names), first, last, noise, margin)


@pytest.mark.parametrize("trainer_name", ["grpo", "nft"])
def test_evaluation_at_eval_steps(tiny_model_dir, tmp_path, trainer_name):
    """eval_dataset + eval_strategy: held-out prompts scored with the deterministic sampler from fixed noise at every
    eval_steps, logged as eval_reward and eval_rewards/<name>/mean|std, with a sample grid in output_dir; held-out
    judges (eval_reward_funcs) as eval_judges/<name>/mean, never in the reward."""
    from trl_dance import DiffusionNFTConfig, DiffusionNFTTrainer

    evaluation = {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 3}
    evaluation |= {"eval_num_generations": 2, "max_steps": 2, "num_completions_to_log": 2}
    evaluation |= {"eval_reward_funcs": ["jpeg_compressibility"]}  # a held-out judge: scored here only
    held_out = Dataset.from_dict({"prompt": ["a blue car", "a small boat"]})
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS)
    if trainer_name == "grpo":
        trainer = DanceGRPOTrainer(
            tiny_model_dir("flux"),
            "brightness",
            tiny_grpo_config(tmp_path, **evaluation),
            Dataset.from_dict({"prompt": PROMPTS[:8]}),
            held_out,
            peft_config=lora,
        )
    else:
        values = (
            tiny_online_values(tmp_path) | evaluation | {"timestep_fraction": 0.5, "gradient_accumulation_steps": 3}
        )
        trainer = DiffusionNFTTrainer(
            tiny_model_dir("flux"),
            "brightness",
            DiffusionNFTConfig(**values),
            Dataset.from_dict({"prompt": PROMPTS[:8]}),
            held_out,
            peft_config=lora,
        )
    before = trainer.evaluate()
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [1, 2]
    assert evals[-1]["eval_reward"] != before["eval_reward"]  # the policy moved
    assert all("eval_rewards/brightness/std" in h and "loss" not in h for h in evals)
    assert all(h["eval_judges/jpeg_compressibility/mean"] < 0 for h in evals)  # minus kB
    assert all(h["eval_reward"] == h["eval_rewards/brightness/mean"] for h in evals)  # judges are not in the reward
    assert not any("rewards/jpeg_compressibility/mean" in h for h in trainer.state.log_history)  # nor in training
    assert (tmp_path / "eval_samples_step2.png").exists()
    # The same policy evaluates identically: fixed noise, no SDE.
    assert trainer.evaluate()["eval_reward"] == evals[-1]["eval_reward"]


def test_eval_dataset_needs_prompts(tiny_model_dir, tmp_path):
    with pytest.raises(
        ValueError, match="eval_dataset must be a datasets.Dataset or IterableDataset with a .prompt. column"
    ):
        DanceGRPOTrainer(
            tiny_model_dir("flux"),
            "brightness",
            tiny_grpo_config(tmp_path),
            Dataset.from_dict({"prompt": PROMPTS[:8]}),
            Dataset.from_dict({"text": ["a boat"]}),
        )


def test_scale_rewards_takes_trls_booleans(tmp_path):
    for value, expected in (
        (True, "group"),
        (False, "none"),
        ("true", "group"),
        ("False", "none"),
        ("batch", "batch"),
    ):
        assert tiny_grpo_config(tmp_path, scale_rewards=value).scale_rewards == expected
