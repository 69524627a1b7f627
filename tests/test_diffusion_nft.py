"""DiffusionNFT: the loss's closed forms, zero gradient at zero advantage, the old policy, resume, bad input, learning."""

import functools

import pytest
import torch
from conftest import (
    LEARNING_SEED,
    LORA_TARGETS,
    PROMPTS,
    family_overrides,
    tiny_online_values,
    train_and_assert_reward_rose,
    train_and_resume,
)
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer, DiffusionNFTConfig, DiffusionNFTTrainer
from trl_dance.losses import awm_log_ratio, dgpo_loss, flow_matching_error, nft_loss, optimality_probability
from trl_dance.trainer.old_policy import OldPolicy, nft_decay

ROWS = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]


def nft_config(output_dir, **overrides) -> DiffusionNFTConfig:
    values = tiny_online_values(output_dir) | {
        "timestep_fraction": 0.5,  # 3 of the 6 noise levels
        "gradient_accumulation_steps": 3,  # the 3 micro-batches of a round (8 samples × 3 levels / 8)
    }
    return DiffusionNFTConfig(**(values | overrides))


def _trainer(tiny_model_dir, tmp_path, kind="flux", lora=True, **overrides):
    peft = LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian") if lora else None
    return DiffusionNFTTrainer(
        tiny_model_dir(kind),
        "brightness",
        args=nft_config(tmp_path, **(family_overrides(kind) | overrides)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
        peft_config=peft,
    )


def test_nft_gradient_closed_form():
    """One sample with r = 1 at v = v_old: ∂L/∂v = −2·scale·σ·(x̂0 − x0)/(w·D), w = mean|x̂0 − x0| (first order:
    flow matching toward x0); with r = ½ (advantage 0) the two terms cancel exactly."""
    g = torch.Generator().manual_seed(0)
    x0, noise, v_old = (torch.randn(1, 4, 6, generator=g) for _ in range(3))
    sigma = torch.tensor([0.7])
    noisy = (1 - sigma) * x0 + sigma * noise
    for beta in (1.0, 0.1):
        velocity = v_old.clone().requires_grad_(True)
        nft_loss(velocity, v_old, noisy, x0, sigma, torch.ones(1), beta, scale=5.0).sum().backward()
        error = noisy - sigma * v_old - x0
        expected = -2 * 5.0 * sigma * error / (error.abs().mean() * error.numel())
        torch.testing.assert_close(velocity.grad, expected, rtol=1e-5, atol=1e-7)
        velocity.grad = None
        nft_loss(velocity, v_old, noisy, x0, sigma, torch.full((1,), 0.5), beta, scale=5.0).sum().backward()
        assert velocity.grad.abs().max() < 1e-7
    assert optimality_probability(torch.tensor([-9.0, -5.0, 0.0, 2.5, 7.0]), 5.0).tolist() == [0, 0, 0.5, 0.75, 1]


def test_awm_and_dgpo_closed_forms():
    """AWM on-policy: ratio 1 and ∂(−A·ρ)/∂v = A·σ·∂ℓ/∂v (advantage-weighted flow matching). DGPO: the group weight
    sigmoid(β/G · Σ A·δ) against a hand computation, and its gradient A·w·∂ℓ/∂v."""
    g = torch.Generator().manual_seed(1)
    x0, noise, v = (torch.randn(4, 3, 5, generator=g) for _ in range(3))
    sigma, advantages = torch.tensor([0.9, 0.6, 0.3, 0.2]), torch.tensor([1.0, -1.0, 0.5, -0.5])
    velocity = v.clone().requires_grad_(True)
    error = flow_matching_error(velocity, noise, x0)
    ratio = torch.exp(awm_log_ratio(error, error.detach(), sigma, "sigma"))
    assert torch.equal(ratio.detach(), torch.ones(4))
    (-advantages * ratio).sum().backward()
    expected = (advantages * sigma).view(-1, 1, 1) * 2 * (v - (noise - x0)) / 15
    torch.testing.assert_close(velocity.grad, expected)
    # ghuber (AWM's default): on-policy gradient A·σ·(ℓ + ε)^(p − 1)·∂ℓ/∂v.
    velocity.grad = None
    error = flow_matching_error(velocity, noise, x0)
    ratio = torch.exp(awm_log_ratio(error, error.detach(), sigma, "ghuber", power=0.25))
    (-advantages * ratio).sum().backward()
    factor = (advantages * sigma * (error.detach() + 1e-10) ** -0.75).view(-1, 1, 1)
    torch.testing.assert_close(velocity.grad, factor * 2 * (v - (noise - x0)) / 15)

    reference = torch.tensor([0.5, 0.5, 0.5, 0.5])
    velocity.grad = None
    error = flow_matching_error(velocity, noise, x0)
    groups = torch.tensor([0, 0, 1, 1])
    loss = dgpo_loss(error, reference, advantages, groups, 2, beta=10.0)
    delta = error.detach() - reference
    weights = torch.sigmoid(
        10.0 * torch.stack([(advantages[:2] * delta[:2]).sum(), (advantages[2:] * delta[2:]).sum()]) / 2
    )
    torch.testing.assert_close(loss.detach(), weights.repeat_interleave(2) * advantages * error.detach())
    loss.sum().backward()
    scale = (weights.repeat_interleave(2) * advantages).view(-1, 1, 1)
    torch.testing.assert_close(velocity.grad, scale * 2 * (v - (noise - x0)) / 15)


@pytest.mark.parametrize("loss_type", ["nft", "awm", "dgpo"])
def test_zero_advantages_give_zero_gradient(tiny_model_dir, tmp_path, loss_type):
    """At θ = θ_old (the first round) a batch whose advantages are all 0 moves nothing: every LoRA gradient is 0."""
    trainer = _trainer(tiny_model_dir, tmp_path, beta=0.0, loss_type=loss_type)
    trainer._generate_and_score(ROWS)
    trainer._rollout["advantages"] = torch.zeros_like(trainer._rollout["advantages"])
    for item in trainer._microbatches:
        trainer.compute_loss(trainer.model, trainer._microbatch(item)).backward()
    grads = [p.grad for p in trainer.model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.abs().max() < 1e-9 for g in grads)
    # With the rollout's advantages the same batch has a gradient.
    trainer.model.zero_grad()
    trainer._generate_and_score(ROWS)
    trainer.compute_loss(trainer.model, trainer._microbatch(trainer._microbatches[0])).backward()
    assert sum(p.grad.abs().sum() for p in trainer.model.parameters() if p.requires_grad) > 0


def test_nft_per_item_optimum_in_closed_form():
    """Where one round's NFT loss stops pulling: its adaptive weights make each item's loss ‖e‖²/mean|e| per implicit
    policy, positively homogeneous of degree 1, so along v_θ − v_old = c·(v* − v_old)/β (v* = ε − x0) the slope is
    constant for every c in [0, 1) and every β, and flips sign at c = 1: the item's optimum is
    v_θ = v_old + sign(2r − 1)·(v* − v_old)/β, where the implicit positive policy (r > ½; the negative one for r < ½)
    predicts x0 exactly. β is the radius of the round's trust region, in units of the old policy's own error; a
    quadratic reading, (2r − 1)(v* − v_old)/β, holds only with the weights frozen equal."""
    g = torch.Generator().manual_seed(0)
    x0, noise, v_old = (torch.randn(3, 4, 6, generator=g, dtype=torch.float64) for _ in range(3))
    sigma = torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64)
    noisy = (1 - sigma.view(-1, 1, 1)) * x0 + sigma.view(-1, 1, 1) * noise
    r = torch.tensor([0.9, 0.7, 0.2], dtype=torch.float64)
    u, sign = (noise - x0) - v_old, torch.sign(2 * r - 1).view(-1, 1, 1)
    for beta in (1.0, 0.1):
        slopes = {}
        for c in (0.0, 0.5, 0.99, 1.01, 1.5):
            v = (v_old + c * sign * u / beta).requires_grad_(True)
            nft_loss(v, v_old, noisy, x0, sigma, r, beta, 5.0).sum().backward()
            slopes[c] = (v.grad * sign * u).sum(dim=(1, 2)) * beta / (2 * u.abs().mean(dim=(1, 2)))
        for c in (0.0, 0.5, 0.99):
            torch.testing.assert_close(slopes[c], slopes[0.0], rtol=1e-5, atol=0)  # nft_loss runs in float32
        assert (slopes[0.99] < 0).all() and (slopes[1.01] > 0).all()
        torch.testing.assert_close(slopes[1.01], slopes[1.5], rtol=1e-5, atol=0)


def test_a_round_of_two_updates_matches_a_transcription_of_the_reference(tiny_model_dir, tmp_path):
    """DiffusionNFT's training loop transcribed from its paper's code (NVlabs/DiffusionNFT, train_nft_sd3.py: the old
    adapter frozen for the round, r = clip(A, ±5)/10 + ½, implicit policies, L1-normalised squared errors, the loss
    times adv_clip_max/β, gradients averaged over the accumulated micro-batches, clipped, AdamW) run on the same items
    as the trainer with old_policy_update="round": the weights after the round's two updates agree to 1e-3 of how far
    they moved (measured: moved 2.0e-3, differ by 1.4e-6, float32 Adam). With the default "step", the second update is
    taken against the moved old policy instead."""
    import copy

    overrides = {"beta": 0.0, "weight_decay": 0.0, "learning_rate": 1e-3, "max_steps": 2, "seed": 3}
    overrides |= {"gradient_accumulation_steps": 3, "per_device_train_batch_size": 4}  # 6 micro-batches: 2 updates
    results = {}
    for update in ("round", "step"):
        trainer = _trainer(tiny_model_dir, tmp_path / update, lora=False, old_policy_update=update, **overrides)
        start = copy.deepcopy(trainer.model)
        trainer.train()
        results[update] = (start, trainer)
    start, trainer = results["round"]
    batches = [trainer._microbatch(item) for item in trainer._microbatches]  # the round's items, noise re-drawn alike
    model, old = copy.deepcopy(start), copy.deepcopy(start).requires_grad_(False)
    policy, args = trainer.policy, trainer.args
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for update in range(2):
        for inputs in batches[3 * update : 3 * update + 3]:
            t = inputs["sigma"]
            s, x0, xt = inputs["sigma"].view(-1, 1, 1), inputs["x0"], inputs["noisy"]
            with torch.no_grad():
                old_v = policy.predict(old, xt, inputs["cond"], at=t)
            v = policy.predict(model, xt, inputs["cond"], at=t)
            r = (inputs["advantages"].clamp(-5, 5) / 5 / 2 + 0.5).clamp(0, 1)
            terms = []
            for implicit in (
                args.nft_beta * v + (1 - args.nft_beta) * old_v,
                (1 + args.nft_beta) * old_v - args.nft_beta * v,
            ):
                x0_hat = xt - s * implicit
                weight = (x0_hat.detach().double() - x0.double()).abs().mean(dim=(1, 2), keepdim=True).clip(min=1e-5)
                terms.append(((x0_hat - x0) ** 2 / weight).mean(dim=(1, 2)))
            loss = ((r * terms[0] + (1 - r) * terms[1]) / args.nft_beta * 5).mean()
            (loss / 3).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    moved = max((a - b).abs().max() for a, b in zip(model.state_dict().values(), start.state_dict().values()))
    trained = dict(trainer.model.named_parameters())
    error = max((p - trained[name]).abs().max() for name, p in model.named_parameters())
    print(f"transcription: weights moved {float(moved):.3e}, differ from the trainer by {float(error):.3e}")
    assert moved > 1e-4 and error < 1e-3 * moved, (float(error), float(moved))
    stepped = dict(results["step"][1].model.named_parameters())
    assert max((p - stepped[name]).abs().max() for name, p in model.named_parameters()) > 10 * error


def test_old_policy_is_a_soft_updated_copy():
    module = torch.nn.Linear(3, 2)
    old = OldPolicy(module)
    with torch.no_grad():
        module.weight.add_(1.0)
    x = torch.randn(4, 3)
    before = old.model(x)
    torch.testing.assert_close(before, torch.nn.functional.linear(x, module.weight - 1.0, module.bias))
    old.update(0.25)  # old ← 0.25·old + 0.75·θ
    torch.testing.assert_close(old.params["weight"], module.weight.detach() - 0.25)
    assert not old.model(x).requires_grad
    assert [nft_decay(s, "linear") for s in (0, 100, 900)] == [0.0, 0.1, 0.5]
    assert [nft_decay(s, "delayed") for s in (74, 75, 175, 500)] == [0.0, 0.0, 0.75, 0.999]


def test_rollouts_are_deterministic_and_store_clean_latents(tiny_model_dir, tmp_path):
    """The old policy samples with the ODE (or DPM-Solver++) and a round keeps one latent per sample."""
    for solver, calls in (("ode", 6), ("dpm_solver++", 6)):
        trainer = _trainer(tiny_model_dir, tmp_path, rollout_solver=solver)
        plan = trainer.rollout_plan()
        assert plan.sde_start == plan.sde_end == 0
        trainer._generate_and_score(ROWS)
        assert trainer._rollout["x0"].shape == (8, *trainer.policy.initial_noise([torch.Generator()]).shape[1:])
        assert "latents" not in trainer._rollout
        history = trainer._metrics["rollout/denoiser_calls_per_sample"]
        assert float(history[-1]) == calls
        levels = torch.cat([item[1] for item in trainer._microbatches])
        assert len(levels) == 8 * 3 and set(levels.tolist()) <= set(range(6))


def test_memory_of_a_round_against_grpo(tiny_model_dir, tmp_path):
    """Per sample, GRPO keeps the N states around its N − 1 stored transitions, NFT one clean latent: N times less
    (for Wan 2.1 14B at 480×832×81 and 20 steps: 8.0 MiB against 160 MiB per video, see docs/methods/nft.md)."""
    nft = _trainer(tiny_model_dir, tmp_path, "wan")
    nft._generate_and_score(ROWS)
    grpo_args = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none", "num_generations": 4}
    grpo_args |= {"generation_batch_size": 8, "num_inference_steps": 6, "height": 32, "width": 32, "num_frames": 5}
    grpo_args |= {"max_sequence_length": 16, "timestep_fraction": 1.0, "per_device_train_batch_size": 8}
    from trl_dance import DanceGRPOConfig

    grpo = DanceGRPOTrainer(
        tiny_model_dir("wan"),
        "brightness",
        args=DanceGRPOConfig(**grpo_args, gradient_accumulation_steps=5),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
    )
    grpo._generate_and_score(ROWS)
    per_sample_nft = nft._rollout["x0"].nbytes // 8
    per_sample_grpo = (grpo._rollout["latents"].nbytes + grpo._rollout["log_probs"].nbytes) // 8
    print(f"stored per video: GRPO {per_sample_grpo} B, NFT {per_sample_nft} B")
    assert per_sample_grpo == 6 * per_sample_nft + 5 * 4  # 6 states and 5 float32 log-probs


def test_resume_restores_the_old_policy_exactly(tiny_model_dir, tmp_path):
    # (with the "linear" decay the first decays are 0.001, 0.002: barely visible)
    make = functools.partial(_trainer, tiny_model_dir)
    full, resumed = train_and_resume(make, tmp_path / "run", learning_rate=1e-3, old_policy_decay="delayed")
    for name, value in full.old_policy.params.items():
        assert torch.equal(value, resumed.old_policy.params[name]), name


def test_bad_input_fails_at_construction(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="flow-matching models"):
        _trainer(tiny_model_dir, tmp_path, "sd")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        nft_config(tmp_path, loss_type="ppo")
    with pytest.raises(ValueError, match="share_initial_noise='none'"):
        nft_config(tmp_path, share_initial_noise="group")
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        nft_config(tmp_path, per_device_train_batch_size=5)
    with pytest.raises(ValueError, match="nft_beta must be > 0"):
        nft_config(tmp_path, nft_beta=0.0)
    with pytest.raises(ValueError, match=r"loss_type='dgpo' weighs whole groups: per_device_train_batch_size \(6\)"):
        nft_config(tmp_path, loss_type="dgpo", per_device_train_batch_size=6, gradient_accumulation_steps=4)


# Gains over seeds 42, 1, 2 with the papers' defaults (DPM-Solver++ on the pipeline grid, batch std; NFT 5 of 6
# levels, AWM 2 stratified, DGPO the 3 highest-noise); the FLUX rows make several optimizer updates per round (NFT 5,
# AWM 4, DGPO 3): NFT FLUX 0.141-0.155, SD3 0.140-0.148, AWM 0.091-0.098, DGPO 0.117-0.150 in 30 rounds; Wan 0.114 /
# 0.120 / 0.151 kB in 20 (0.159-0.186 in 30) (sample std <= 0.009); each margin is at most the smallest gain / 2.3.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "reward", "loss_type", "updates", "margin"),
    [
        ("flux", "brightness", "nft", 5, 0.05),
        ("sd3", "brightness", "nft", 1, 0.05),
        ("wan", "jpeg_compressibility", "nft", 1, 0.045),  # 20 rounds
        ("flux", "brightness", "awm", 4, 0.04),
        ("flux", "brightness", "dgpo", 3, 0.05),
    ],
)
def test_reward_rises_with_ode_rollouts_and_no_cfg(tiny_model_dir, tmp_path, kind, reward, loss_type, updates, margin):
    """Learning: DiffusionNFT, AWM and DGPO with their defaults on deterministic rollouts without CFG raise the reward
    beyond its sample std, with one or several optimizer updates per round (the random Wan VAE barely lets latents
    move the brightness; the frames' JPEG compressibility it does)."""
    rounds = 20 if kind == "wan" else 30
    values = {"generation_batch_size": 32, "per_device_train_batch_size": 16, "max_steps": rounds * updates}
    values["timestep_fraction"] = None  # the loss type's own
    values |= {"guidance_scale": 3.5 if kind == "flux" else 1.0, "loss_type": loss_type, "seed": LEARNING_SEED}
    micro_batches = nft_config(tmp_path, **family_overrides(kind), **values, gradient_accumulation_steps=None)
    accumulation = micro_batches.steps_per_generation // updates
    args = nft_config(tmp_path, **family_overrides(kind), **values, gradient_accumulation_steps=accumulation)
    assert args.steps_per_generation // args.gradient_accumulation_steps == updates
    trainer = DiffusionNFTTrainer(
        tiny_model_dir(kind),
        reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS),
    )
    train_and_assert_reward_rose(trainer, reward, margin)


@pytest.mark.slow
def test_nft_learns_at_least_as_much_per_round_with_five_updates(tiny_model_dir, tmp_path):
    """Issue #41's setting (full fine-tuning, Adam lr 1e-3, one group of 4 per round, 5 of 6 levels, 24 rounds) with
    a colour reward: NFT's defaults (the old policy moved after every update) learn at least as much per round with 5
    updates as with 1, where the reference's once-per-round old policy learns almost nothing with 5
    (benchmarks/nft_updates.py: gains in first-round stds, seeds 0/1: 3.6/9.8 with 1 update; 9.1/34.2 with 5, against
    0.6/0.4 with the old policy moved per round)."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "benchmarks"))
    from nft_updates import run

    gains = {updates: run(tiny_model_dir("flux"), "nft", {}, updates, LEARNING_SEED) for updates in (1, 5)}
    print(f"NFT gains in first-round stds by updates per round: {gains}")
    assert gains[1] > 1 and gains[5] >= gains[1], gains
