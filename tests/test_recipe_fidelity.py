"""Recipes and defaults as the published code trains, and no run that trains nothing in silence (issue #34)."""

import logging
import math

import pytest
import torch
import yaml
from conftest import LEARNING_SEED, LORA_TARGETS, PROMPTS, assert_learned, tiny_grpo_config, tiny_online_values
from datasets import Dataset
from peft import LoraConfig

from trl_dance import (
    DanceGRPOConfig,
    DanceGRPOTrainer,
    DiffusionNFTConfig,
    OnlineDiffusionDPOConfig,
    OnlineDiffusionDPOTrainer,
    SPOConfig,
    SPOTrainer,
)
from trl_dance.advantages import normalized_reward_sum
from trl_dance.direct_align import draw_positions
from trl_dance.losses import dgpo_loss
from trl_dance.rewards.video_align import sampled_frames

CPU = {"output_dir": "unused", "use_cpu": True, "bf16": False, "report_to": "none"}
LORA = LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])


def _recipe(name: str) -> dict:
    with open(f"recipes/configs/{name}.yaml") as f:
        return yaml.safe_load(f)


# ------------------------------------------------------------------------------------------------------------------
# Defaults a TRL user can use


def test_default_accumulation_adapts_to_small_configurations():
    """Unset, gradient_accumulation_steps gives at most the method's updates per round (DanceGRPO 3, NFT 1); a value
    given that does not divide a round is refused with its divisors."""
    small = DanceGRPOConfig(**CPU, per_device_train_batch_size=4, num_generations=4, num_inference_steps=6)
    assert (small.steps_per_generation, small.gradient_accumulation_steps) == (3, 1)  # 3 micro-batches: 3 updates
    recipe = DanceGRPOConfig(**CPU)  # 12 samples × 9 transitions: DanceGRPO's 36 per update
    assert (recipe.steps_per_generation, recipe.gradient_accumulation_steps) == (108, 36)
    odd = DanceGRPOConfig(**CPU, per_device_train_batch_size=1, num_generations=5, num_inference_steps=6)
    assert odd.steps_per_generation // odd.gradient_accumulation_steps <= 3  # 15 micro-batches: 3 updates of 5
    nft = DiffusionNFTConfig(**CPU, num_generations=4, num_inference_steps=6, per_device_train_batch_size=4)
    assert nft.gradient_accumulation_steps == nft.steps_per_generation  # one update per round
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps \(2\) must divide the 3 .* Divisors: \[1, 3\]"):
        DanceGRPOConfig(
            **CPU,
            per_device_train_batch_size=4,
            num_generations=4,
            num_inference_steps=6,
            gradient_accumulation_steps=2,
        )


def test_batch_size_errors_name_the_field_to_change():
    with pytest.raises(
        ValueError, match=r"1 chains × 16 pool steps .* set per_device_train_batch_size to one of \[1, 2, 4, 8, 16\]"
    ):
        SPOConfig(**CPU, generation_batch_size=1, per_device_train_batch_size=3)
    with pytest.raises(
        ValueError, match=r"1 pairs \(one per prompt\).*set per_device_train_batch_size to one of \[1\]"
    ):
        OnlineDiffusionDPOConfig(**CPU, per_device_train_batch_size=2)


def test_timestep_fraction_trains_whole_windows_unless_asked():
    assert DanceGRPOConfig(**CPU).timestep_fraction == 0.6
    window = DanceGRPOConfig(**CPU, sde_window_size=4)
    assert window.timestep_fraction == 1.0 and window.timesteps_per_sample == 4
    assert DanceGRPOConfig(**CPU, sde_window_size=4, timestep_fraction=0.5).timesteps_per_sample == 2


# ------------------------------------------------------------------------------------------------------------------
# Ported variants


def test_group_normalize_then_sum_is_mixgrpos_aggregation():
    """MixGRPO's advantage_aggr / DanceGRPO's VQ + MQ: Σ_f w_f (r_f − mean_g)/(std_g + 1e-8), no renormalisation over
    the batch (which TRL's normalize_then_sum adds)."""
    rewards = torch.tensor([[1.0, 10.0], [2.0, 30.0], [4.0, 20.0], [0.0, 0.0], [1.0, 5.0], [5.0, 1.0]])
    weights = torch.tensor([1.0, 0.5])
    expected = torch.zeros(6)
    for g in range(2):
        block = rewards[3 * g : 3 * g + 3]
        expected[3 * g : 3 * g + 3] = (((block - block.mean(0)) / (block.std(0) + 1e-8)) * weights).sum(1)
    got = normalized_reward_sum(rewards, weights, 3, clip=None, epsilon=1e-8, renormalize=False)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(normalized_reward_sum(rewards, weights, 3, clip=None), expected)


def test_kl_of_cps_is_the_exact_kl_in_both_scalings(tiny_model_dir, tmp_path):
    """kl_scaling='flow_grpo' multiplies the exact KL by Δσ for the Gaussian SDEs (Flow-GRPO's units), but not for CPS,
    whose std already is the step's own."""
    kls = {}
    for sde_type, scaling in [
        ("cps", "gaussian"),
        ("cps", "flow_grpo"),
        ("dance", "gaussian"),
        ("dance", "flow_grpo"),
    ]:
        args = tiny_grpo_config(
            tmp_path / sde_type / scaling, sde_type=sde_type, eta=0.7, beta=0.1, kl_scaling=scaling
        )
        trainer = DanceGRPOTrainer(
            tiny_model_dir("flux"),
            "brightness",
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
            peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS),
        )
        with torch.no_grad():  # the policy away from its LoRA-disabled reference
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
        trainer._generate_and_score([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
        with torch.no_grad():
            trainer.compute_loss(trainer.model, trainer._microbatch(trainer._microbatches[0]))
        kls[sde_type, scaling] = trainer._metrics["kl"][-1]
    assert kls["cps", "gaussian"] > 0 and torch.equal(kls["cps", "gaussian"], kls["cps", "flow_grpo"])
    assert kls["dance", "flow_grpo"] < 0.5 * kls["dance", "gaussian"]  # × Δσ < 1/2 on a 6-step grid


def test_srpo_positions_include_both_ends_and_dgpo_keeps_float64():
    draws = draw_positions(50_000, torch.Generator().manual_seed(0))
    assert draws.min() == 5 and draws.max() == 995  # random.randint(5, 995)
    error = torch.rand(4, dtype=torch.float64, requires_grad=True)
    loss = dgpo_loss(error, torch.rand(4, dtype=torch.float64), torch.tensor([1.0, -1.0, 0.5, -0.5]),
                     torch.tensor([0, 0, 1, 1]), 2, 10.0)  # fmt: skip
    assert loss.dtype == torch.float64


# ------------------------------------------------------------------------------------------------------------------
# Recipes that claim a published setting


def test_srpo_recipe_samples_deterministically_and_trains_at_guidance_3_5():
    recipe = _recipe("srpo_flux")
    assert recipe["eta"] == 0.0 and recipe["guidance_scale"] == 1.0 and recipe["train_guidance_scale"] == 3.5


def test_nft_multi_reward_recipe_sums_cosines_as_diffusionnft():
    """DiffusionNFT sums PickScore/26 (its scorer's logit_scale·cos / 26), the HPS v2.1 cosine and the CLIP cosine
    (logits / 100). Here pickscore and clip_score are 100·cos and hpsv2 the cosine, so the weights are 1/26, 1 and
    1/100; per unit of cosine each reward then weighs 3.85, 1 and 1 (raw, HPS weighed 1 % of PickScore)."""
    recipe = _recipe("nft_sd3")
    weights = dict(zip(recipe["reward_funcs"], recipe["reward_weights"]))
    per_cosine = {
        "pickscore": 100 * weights["pickscore"],
        "hpsv2": weights["hpsv2"],
        "clip_score": 100 * weights["clip_score"],
    }
    assert per_cosine == pytest.approx({"pickscore": 100 / 26, "hpsv2": 1.0, "clip_score": 1.0}, rel=1e-5)
    assert min(per_cosine.values()) / max(per_cosine.values()) > 0.25  # every reward's spread contributes
    assert recipe["nft_beta"] == 0.1 and recipe["num_inference_steps"] == 25


def test_hunyuan_video_recipe_is_dancegrpos():
    recipe = _recipe("grpo_hunyuan_video")
    assert (recipe["num_generations"], recipe["best_of_n_k"], recipe["eta"]) == (24, 4, 0.25)
    assert recipe["reward_kwargs"]["videoalign"] == {"dimension": "VQ", "video_fps": 8}
    assert len(sampled_frames(recipe["num_frames"], 8, 2.0, None)) == 14  # not 4 at 24 fps
    assert len(sampled_frames(recipe["num_frames"], 24, 2.0, None)) == 4
    args = DanceGRPOConfig(**(CPU | {k: v for k, v in recipe.items() if k in DanceGRPOConfig.__dataclass_fields__}))
    assert args.steps_per_generation == args.gradient_accumulation_steps  # one update per round over 8 of 24 videos


# ------------------------------------------------------------------------------------------------------------------
# Direct-Align on any reward scale


class ShiftedBrightness:
    """A differentiable reward on PickScore's scale: 20 + 200·(brightness − 0.4), about 20 ± 1 on the tiny FLUX."""

    __name__ = "shifted_brightness"

    def score(self, prompts, images):
        return 20 + 200 * (images.mean(dim=(1, 2, 3)) - 0.4)

    def __call__(self, prompts, images, **kwargs):
        return self.score(prompts, images).tolist()


def _direct(tiny_model_dir, tmp_path, reward, **overrides):
    from test_direct_reward import _trainer  # the Direct-Align tests' tiny FLUX trainer

    return _trainer(tiny_model_dir, tmp_path, reward=reward, seed=LEARNING_SEED, **overrides)


# Gains (first 2 → last 2 logged rounds, in the reward's units, ~20 ± 1 at the start) over seeds 42, 1, 2 × 1 and 2
# threads: 16.2-17.3, round std <= 2.04; the margin 4 is the smallest gain / 4.
@pytest.mark.slow
def test_direct_align_defaults_train_a_reward_on_pickscores_scale(tiny_model_dir, tmp_path, caplog):
    """With Direct-Align's defaults (SRP on, margin 0.7) a reward of scale ~20 is centred and scaled by its first
    round's statistics and rises; its hinge is active on every item. It ignores the prompt, so it trains without
    SRP (which would leave k·r of it), with a warning."""
    trainer = _direct(tiny_model_dir, tmp_path, ShiftedBrightness(), max_steps=40, generation_batch_size=8)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "'shifted_brightness' ignores its prompt" in caplog.text  # SRP would reduce it to k·r
    assert trainer._srp == [False]
    scale, offset = trainer._reward_affine[0]
    assert 15 < offset < 25 and scale > 0
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    rewards = [entry["reward"] for entry in logs]
    assert logs[0]["direct_align/hinge_active"] == 1.0  # (it caps ~35 first-round stds up: 0.7 / 0.02)
    noise = max(entry["reward_std"] for entry in logs)
    assert_learned("shifted_brightness", sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2, noise, margin=4.0)


def test_an_inactive_hinge_is_reported_then_stops_training(tiny_model_dir, tmp_path, caplog):
    """The same reward taken raw (reward_scales [1], SRP and inversion off) sits above the margin on every item: each round warns with
    the cause and the field to change, and max_idle_rounds such rounds stop training."""
    trainer = _direct(
        tiny_model_dir,
        tmp_path,
        ShiftedBrightness(),
        reward_scales=[1.0],
        srp=False,
        inversion=False,
        max_steps=10,
        max_idle_rounds=2,
    )
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match=r"2 rounds in a row trained nothing"):
        trainer.train()
    assert "hinge ReLU(0.7 − r) was inactive on every item" in caplog.text and "lower reward_scales" in caplog.text
    assert trainer.state.global_step == 2  # one update per round


def test_a_reward_without_gradient_is_reported(tiny_model_dir, tmp_path):
    """A reward that rounds pixels has zero gradient: every update's gradient norm is 0 (while weight decay would still
    move the LoRA), and training stops naming the reward's gradient."""

    class Rounded:
        __name__ = "rounded"

        def score(self, prompts, images):
            return (images * 255).round().mean(dim=(1, 2, 3)) / 255

        def __call__(self, prompts, images, **kwargs):
            return self.score(prompts, images).tolist()

    trainer = _direct(tiny_model_dir, tmp_path, Rounded(), max_steps=10, max_idle_rounds=2, srp=False)
    with pytest.raises(RuntimeError, match="reward's gradient was exactly zero in every update"):
        trainer.train()


def test_train_guidance_is_separate_from_the_rollouts(tiny_model_dir, tmp_path):
    """SRPO samples at guidance 1 and trains at 3.5: the rollout policy keeps guidance 1, the Direct-Align step
    predicts with FLUX's guidance embedding at 3.5."""
    trainer = _direct(tiny_model_dir, tmp_path, "brightness", guidance_scale=1.0, train_guidance_scale=3.5)
    assert trainer.policy.settings.guidance_scale == 1.0 and trainer._train_policy.settings.guidance_scale == 3.5
    policy = trainer.policy
    cond = policy.encode_prompts(PROMPTS[:2])
    latents = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(2)])
    level = torch.full((2,), 0.6)
    with torch.no_grad():
        trained = trainer._train_policy.predict(trainer.model, latents, cond, at=level)
        rollout = policy.predict(trainer.model, latents, cond, at=level)
    assert not torch.allclose(trained, rollout)


# ------------------------------------------------------------------------------------------------------------------
# SPO and online DPO


def _spo(tiny_model_dir, tmp_path, **overrides):
    values = tiny_online_values(tmp_path) | {
        "num_generations": 1,
        "generation_batch_size": 2,
        "pool_start_step": 2,
        "per_device_train_batch_size": 8,
    }
    return SPOTrainer(
        tiny_model_dir("sd"),
        "brightness",
        args=SPOConfig(**(values | overrides)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS),
    )


def test_spo_default_scale_keeps_pairs_whatever_the_units(tiny_model_dir, tmp_path):
    """SPO's defaults (threshold 0.3, score_scale unset) with brightness, whose candidate gaps are ~1e-3: a pool is
    kept when its gap exceeds 2·atanh(0.3) = 0.62 of the round's mean gap, so some but not all are; a fixed scale of 1
    keeps none."""
    trainer = _spo(tiny_model_dir, tmp_path)
    trainer._generate_and_score([{"prompt": p} for p in PROMPTS[:2]])
    gap, keep = trainer._rollout["score_gap"], trainer._rollout["keep"]
    assert gap.max() < 0.05 and 0 < keep.float().mean() < 1
    torch.testing.assert_close(keep, gap / gap.mean() > 2 * math.atanh(0.3))
    fixed = _spo(tiny_model_dir, tmp_path / "fixed", score_scale=1.0)
    fixed._generate_and_score([{"prompt": p} for p in PROMPTS[:2]])
    assert not fixed._rollout["keep"].any()


def test_spo_drops_pairs_without_reweighting_the_rest(tiny_model_dir, tmp_path):
    """Kept pairs fill the first micro-batches, and a micro-batch's loss is the sum over its kept pairs divided by its
    size, not by how many were kept: at the LoRA's initialisation every pair's loss is ln 2, so a micro-batch of two
    holding one kept pair has loss ln 2 / 2."""
    trainer = _spo(tiny_model_dir, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    trainer._generate_and_score([{"prompt": p} for p in PROMPTS[:2]])
    keep = trainer._rollout["keep"].flatten()
    kept = int(keep.sum())
    assert 0 < kept < len(keep)
    order = torch.cat(trainer._microbatches)
    assert keep[order[:kept]].all() and not keep[order[kept:]].any()
    for pairs in trainer._microbatches:
        with torch.no_grad():
            loss = trainer.compute_loss(trainer.model, trainer._microbatch(pairs))
        assert loss.item() == pytest.approx(keep[pairs].sum().item() * math.log(2) / 2, abs=1e-5)


@pytest.mark.parametrize("method", ["spo", "online_dpo"])
def test_constant_preferences_stop_training_with_their_cause(tiny_model_dir, tmp_path, caplog, method):
    """A constant step scorer (SPO) or a reward that ties every sample (online DPO) keeps no pair: each round warns
    with the cause, and max_idle_rounds rounds stop training."""

    def constant(prompts, images, *args, **kwargs):
        return [0.5] * len(prompts) if not args else torch.full((len(prompts),), 0.5)

    if method == "spo":
        trainer = _spo(tiny_model_dir, tmp_path, max_steps=6, max_idle_rounds=2)
        trainer.step_scorer = constant
        cause = "no pool passed pair_threshold 0.3"
    else:
        values = tiny_online_values(tmp_path) | {
            "per_device_train_batch_size": 2,
            "max_steps": 6,
            "max_idle_rounds": 2,
        }
        trainer = OnlineDiffusionDPOTrainer(
            tiny_model_dir("sd3"),
            constant,
            args=OnlineDiffusionDPOConfig(**values),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS),
        )
        cause = "every pair's reward gap was zero or below min_margin"
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match=cause):
        trainer.train()
    assert f"round 0 trained nothing: {cause}" in caplog.text


def test_constant_rewards_stop_grpo(tiny_model_dir, tmp_path):
    def constant(prompts, images, **kwargs):
        return [1.0] * len(prompts)

    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"),
        constant,
        args=tiny_grpo_config(tmp_path, max_steps=6, max_idle_rounds=2),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS),
    )
    with pytest.raises(RuntimeError, match="every advantage is zero"):
        trainer.train()


# ------------------------------------------------------------------------------------------------------------------
# DiffusionNFT, AWM and DGPO as their papers' code


def _nft(tiny_model_dir, tmp_path, **overrides):
    from trl_dance import DiffusionNFTTrainer

    values = tiny_online_values(tmp_path) | {"per_device_train_batch_size": 4} | overrides
    return DiffusionNFTTrainer(
        tiny_model_dir("flux"),
        "brightness",
        args=DiffusionNFTConfig(**values),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS),
    )


def test_nft_defaults_are_the_papers(tiny_model_dir, tmp_path):
    """DPM-Solver++ rollouts on the pipeline's σ grid (ending near 0, not at the dance grid's σ), advantages from each
    prompt's mean and the batch's population std + 1e-4 (DiffusionNFT's PerPromptStatTracker(global_std=True))."""
    trainer = _nft(tiny_model_dir, tmp_path, timestep_fraction=0.5)
    args = trainer.args
    assert (args.rollout_solver, args.sigma_schedule, args.scale_rewards) == ("dpm_solver++", "pipeline", "batch")
    assert (args.old_policy_decay, args.timestep_selection, args.ema_kl_beta, args.dgpo_clip) == (
        "linear",
        "random",
        0,
        0,
    )
    rewards = torch.tensor([0.3, 0.5, 0.1, 0.9, 2.0, 2.0, 2.5, 1.5])
    expected = torch.cat([(g - g.mean()) for g in rewards.view(2, 4)]) / (rewards.numpy().std() + 1e-4)
    torch.testing.assert_close(
        trainer._advantages(rewards[:, None], rewards, PROMPTS[:2]), expected.float().clamp(-5, 5)
    )


def test_awm_ratio_against_the_round_start_its_scaled_advantages_and_ema_regulariser(tiny_model_dir, tmp_path):
    """AWM: the old policy is θ at the start of the round (which samples it), the surrogate takes A/adv_clip_max, the
    levels are one per stratum of the grid's levels 1 … ⌊0.9·N⌋, and β·mean((v − v_ema)²) to a fast EMA (decay
    min(0.3, 0.001·step)) joins the loss."""
    trainer = _nft(tiny_model_dir, tmp_path, loss_type="awm", gradient_accumulation_steps=1, max_steps=3)
    args = trainer.args
    assert (args.old_policy_decay, args.timestep_selection, args.ema_kl_beta) == ("none", "stratified", 1.0)
    assert trainer._levels.tolist() == [1, 2, 3, 4, 5] and args.timesteps_per_sample == 2  # ⌊0.9·6⌋ = 5, ⌊6·0.45⌋
    draws = trainer._draw_levels(4000, 2)
    assert set(draws[:, 0].tolist()) == {0, 1, 2} and set(draws[:, 1].tolist()) == {3, 4}  # strata [1-3], [4-5]
    trainer.train()  # 8 samples × 2 levels / 4: 4 micro-batches, the first 3 updates of one round
    # The old policy is θ at the round's start: unchanged within the round, while θ and the fast EMA moved.
    lora = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    moved = max((trainer.old_policy.params[n] - p).abs().max() for n, p in lora.items())
    assert moved > 0 and "ema_kl" in trainer.state.log_history[-2]
    ema_gap = max((trainer.fast_ema.params[n] - p).abs().max() for n, p in lora.items())
    assert 0 < ema_gap < moved  # the EMA follows θ (decay ≤ 0.003 here) but lags its last update


def test_awm_surrogate_takes_advantages_over_the_clip():
    from trl_dance.losses import clipped_surrogate

    ratio, advantages = torch.tensor([1.0, 1.0]), torch.tensor([5.0, -2.5])
    torch.testing.assert_close(clipped_surrogate(ratio, advantages / 5.0, 1.0), torch.tensor([-1.0, 0.5]))


def test_dgpo_clip_stops_samples_past_the_band():
    """clip_dsm: ρ = exp(ℓ_old − ℓ_θ); a positive sample whose loss already fell below the old model's by more than
    the band (ρ > 1 + c), or a negative one whose loss rose past it (ρ < 1 − c), contributes no gradient."""
    error = torch.tensor([0.5, 0.5, 0.5, 0.5], requires_grad=True)
    old = torch.tensor([0.6, 0.5, 0.4, 0.5])  # ρ = e^0.1, 1, e^−0.1, 1
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss = dgpo_loss(error, torch.full((4,), 0.5), advantages, torch.tensor([0, 0, 1, 1]), 2, 10.0, old, 1e-2)
    loss.sum().backward()
    assert error.grad[0] == 0 and error.grad[2] == 0 and error.grad[1] != 0 and error.grad[3] != 0
    error.grad = None
    dgpo_loss(error, torch.full((4,), 0.5), advantages, torch.tensor([0, 0, 1, 1]), 2, 10.0).sum().backward()
    assert (error.grad != 0).all()  # no clip without an old model


def test_dgpo_trains_the_highest_noise_levels_and_can_sample_with_cfg_train_without(tiny_model_dir, tmp_path):
    trainer = _nft(tiny_model_dir, tmp_path, loss_type="dgpo", gradient_accumulation_steps=2)
    args = trainer.args
    assert (args.timestep_selection, args.dgpo_clip, args.timesteps_per_sample) == ("first", 1e-2, 3)
    trainer._generate_and_score([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    levels = torch.cat([item[1] for item in trainer._microbatches])
    assert set(levels.tolist()) == {0, 1, 2}  # the 3 highest-noise of 6
    from trl_dance import DiffusionNFTTrainer

    values = tiny_online_values(tmp_path / "cfg") | {"per_device_train_batch_size": 4, "loss_type": "dgpo"}
    values |= {"guidance_scale": 4.5, "train_guidance_scale": 1.0, "gradient_accumulation_steps": 2}
    cfg = DiffusionNFTTrainer(
        tiny_model_dir("sd3"),
        "brightness",
        args=DiffusionNFTConfig(**values),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS),
    )
    assert cfg.policy.use_cfg and not cfg._train_policy.use_cfg
