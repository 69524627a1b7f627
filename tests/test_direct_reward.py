"""DirectRewardTrainer: Direct-Align's closed forms and noise levels against SRPO's formulas, the reward gradient through
one model step, x̂0, the VAE decode and the reward against finite differences, DRaFT K = 1 = Direct-Align without
re-noising, and rewards that rise on the tiny FLUX."""

import functools

import pytest
import torch
from conftest import LEARNING_SEED, PROMPTS, assert_learned, tiny_online_values, train_and_resume
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DirectRewardConfig, DirectRewardTrainer
from trl_dance.direct_align import direct_align_levels, semantic_relative_reward
from trl_dance.forward_process import add_noise, euler_step, flow_coefficients, recover_clean
from trl_dance.sampling import solve


def _config(output_dir, **overrides):
    values = tiny_online_values(output_dir) | {
        "num_generations": 1,
        "generation_batch_size": 4,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 1.0,
        "weight_decay": 0.0,
        "learning_rate": 1e-2,
    }
    return DirectRewardConfig(**(values | overrides))


def _trainer(tiny_model_dir, tmp_path, kind="flux", lora=True, reward="brightness", **overrides):
    peft = LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]) if lora else None
    return DirectRewardTrainer(
        tiny_model_dir(kind),
        reward,
        args=_config(tmp_path / "out", **overrides),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=peft,
    )


def test_closed_forms_and_srpo_noise_levels():
    x0, noise = torch.randn(3, 4, 2, 2, dtype=torch.float64), torch.randn(3, 4, 2, 2, dtype=torch.float64)
    sigma, sigma_next = torch.tensor([0.9, 0.5, 0.2], dtype=torch.float64), torch.tensor([0.7, 0.6, 0.0])
    noisy = add_noise(x0, noise, *flow_coefficients(sigma))
    torch.testing.assert_close(noisy, sigma.view(-1, 1, 1, 1) * noise + (1 - sigma.view(-1, 1, 1, 1)) * x0)
    # the known noise gives x0 back exactly
    torch.testing.assert_close(recover_clean(noisy, noise, *flow_coefficients(sigma)), x0)
    # The exact velocity ε − x0 moves along the same line, toward less or more noise alike.
    torch.testing.assert_close(
        euler_step(noisy, noise - x0, sigma, sigma_next.double()),
        add_noise(x0, noise, *flow_coefficients(sigma_next.double())),
    )
    # SRPO's indices: window of L = 1000, gap 101; denoise from L − (mid + gap) to L − mid; inversion from L − m to
    # L − (m + gap) with m = max(mid − gap, 1); the gap shortens near the ends.
    window = torch.linspace(0.9, 0.5, 1000, dtype=torch.float64)
    mid = torch.tensor([500, 500, 50, 50, 990])
    inversion = torch.tensor([False, True, False, True, False])
    sigma_from, sigma_to, m = direct_align_levels(mid, inversion, window, 101)
    assert m.tolist() == [500, 399, 50, 1, 990]
    expected_from = [window[399], window[601], window[900], window[999], window[0]]
    expected_to = [window[500], window[500], window[950], window[949], window[10]]
    torch.testing.assert_close(sigma_from, torch.stack(expected_from))
    torch.testing.assert_close(sigma_to, torch.stack(expected_to))
    assert (sigma_from[~inversion] > sigma_to[~inversion]).all() and (
        sigma_from[inversion] < sigma_to[inversion]
    ).all()


def test_semantic_relative_reward_is_linear_in_the_text_side():
    def score(prompts, images):  # ⟨f_img, f_txt⟩ with f_txt from the prompt's first word
        words = {"Real.": 1.0, "Anime.": -0.5}
        return images.sum(dim=(1, 2, 3)) * torch.tensor([words[p.split()[0]] for p in prompts])

    images = torch.rand(2, 3, 4, 4)
    k = torch.tensor([0.1, 0.25])
    value = semantic_relative_reward(score, ["a cat", "a dog"], images, "Real", "Anime", k)
    torch.testing.assert_close(value, images.sum(dim=(1, 2, 3)) * ((1 + k) * 1.0 + 0.5))
    # The inversion branch swaps the words' roles, from the same two scorings.
    swapped = semantic_relative_reward(
        score, ["a cat", "a dog"], images, "Real", "Anime", k, torch.tensor([False, True])
    )
    expected = images.sum(dim=(1, 2, 3)) * torch.stack([(1 + k[0]) * 1.0 + 0.5, (1 + k[1]) * -0.5 - 1.0])
    torch.testing.assert_close(swapped, expected)


@pytest.mark.parametrize("kind", ["flux", "sd"])
def test_reward_gradient_through_step_x0_and_decode_matches_finite_differences(tiny_model_dir, tmp_path, kind):
    """d/dθ of r(decode(x̂0(θ))) along a random direction of the denoiser's output layer, against central finite
    differences with the models in float64. Measured relative error: FLUX 4e-9 (step 1e-4); SD1.5 2e-4 (step 1e-5:
    its decoded pixels at the [0, 1] clamp make the finite differences noisier)."""
    trainer = _trainer(tiny_model_dir, tmp_path, kind=kind, lora=False, srp=True)
    model = trainer.model.double()
    trainer.policy.pipeline.vae.double()
    cond = {k: v.double() for k, v in trainer.policy.encode_prompts(PROMPTS[:2]).items()}
    noise = trainer.policy.initial_noise([torch.Generator().manual_seed(i) for i in range(2)]).double()
    x0 = torch.randn(noise.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    sigma_from, sigma_to = torch.tensor([0.8, 0.6], dtype=torch.float64), torch.tensor([0.7, 0.4], dtype=torch.float64)
    inversion, position = torch.tensor([False, True]), torch.tensor([300, 600])
    layer, eps, tolerance = {"flux": ("proj_out.weight", 1e-4, 1e-6), "sd": ("conv_out.weight", 1e-5, 1e-3)}[kind]
    weight = next(p for n, p in model.named_parameters() if n.endswith(layer))
    direction = torch.randn(weight.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def loss():
        clean = trainer.clean_latents(
            model, trainer.policy.process.add_noise(x0, noise, sigma_from), noise, sigma_from, sigma_to, cond
        )
        reward = trainer.item_rewards(trainer.decode(clean), PROMPTS[:2], inversion, position)
        return torch.relu(2.0 - reward).sum()

    model.zero_grad()
    loss().backward()
    analytic = (weight.grad * direction).sum().item()
    with torch.no_grad():
        weight.add_(eps * direction)
        plus = loss().item()
        weight.sub_(2 * eps * direction)
        minus = loss().item()
        weight.add_(eps * direction)
    numeric = (plus - minus) / (2 * eps)
    assert abs(analytic) > 1e-4 and abs(analytic - numeric) <= tolerance * abs(numeric)


@pytest.mark.parametrize("kind", ["flux", "sd3", "sd", "sdxl"])
def test_draft_without_gradients_is_the_sampler(tiny_model_dir, tmp_path, kind):
    """DRaFT's steps are the deterministic sampler's: without gradients they end where the round's rollout ends."""
    trainer = _trainer(tiny_model_dir, tmp_path, kind=kind, method="draft")
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    noise = trainer.policy.initial_noise([torch.Generator().manual_seed(i) for i in range(2)])
    rollout = trainer.sample(PROMPTS[:2], generators, initial_noise=noise)
    with torch.no_grad():
        draft = trainer.draft_latents(trainer.model, noise, trainer.policy.encode_prompts(PROMPTS[:2]), 3)
    torch.testing.assert_close(draft, rollout["final_latents"])


def test_draft_with_one_step_is_direct_align_without_renoising(tiny_model_dir, tmp_path):
    """DRaFT K = 1 from the sampler's state at σ_{N−1} and Direct-Align's step from that same state to σ = 0 give the
    same clean latents and the same gradient."""
    trainer = _trainer(tiny_model_dir, tmp_path, method="draft")
    policy, model = trainer.policy, trainer.model
    cond = policy.encode_prompts(PROMPTS[:2])
    noise = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(2)])
    sigmas = tuple(policy.process.sigmas.tolist())
    with torch.no_grad():
        state = solve(policy, model, noise, cond, sigmas[:-1])  # σ_0 … σ_{N−1}
    gradients = []
    for clean in (
        lambda: trainer.draft_latents(model, noise, cond, 1),
        lambda: trainer.clean_latents(model, state, noise, torch.full((2,), sigmas[-2]), torch.zeros(2), cond),
    ):
        model.zero_grad()
        latents = clean()
        latents.square().mean().backward()
        gradients.append((latents.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    torch.testing.assert_close(gradients[0][0], gradients[1][0])
    for a, b in zip(gradients[0][1], gradients[1][1]):
        torch.testing.assert_close(a, b)


def test_bad_input_is_refused(tiny_model_dir, tmp_path):
    def plain(prompts, images, **kwargs):
        return [0.0] * len(prompts)

    with pytest.raises(ValueError, match=r"backpropagates through the reward; \['plain'\] only return floats"):
        _trainer(tiny_model_dir, tmp_path, reward=plain)
    with pytest.raises(ValueError, match="direct_align_window must be two schedule entries"):
        _config(tmp_path, direct_align_window=[25, 5])


class _Scorer:
    """A differentiable reward whose score() returns what ``shape`` says (the ways a user's scorer goes wrong)."""

    def __init__(self, shape):
        self.shape, self.__name__ = shape, f"scorer_{shape}"

    def __call__(self, prompts, images, **kwargs):
        return images.mean(dim=(1, 2, 3)).tolist()

    def score(self, prompts, images):
        mean = images.mean(dim=(1, 2, 3))
        return {"detached": mean.detach(), "wide": mean[:, None].expand(-1, 3), "short": mean[1:],
                "list": mean.tolist(), "ok": mean}[self.shape]  # fmt: skip


def test_direct_reward_scorers_are_checked_naming_the_reward(tiny_model_dir, tmp_path):
    from trl_dance.trainer.direct_reward_trainer import checked_score

    images = torch.rand(4, 3, 8, 8, requires_grad=True)
    for shape, message in [
        ("detached", "'scorer_detached'.*does not require grad"),
        ("wide", r"'scorer_wide'.*\(B,\) = \(4,\).*shape \(4, 3\)"),
        ("short", r"'scorer_short'.*shape \(3,\)"),
        ("list", "'scorer_list'.*got list"),
    ]:
        with pytest.raises(ValueError, match=message):
            checked_score(_Scorer(shape), ["a"] * 4, images)
    assert checked_score(_Scorer("ok"), ["a"] * 4, images).requires_grad
    # In training: the named error, not autograd's "element 0 of tensors does not require grad".
    trainer = _trainer(tiny_model_dir, tmp_path, reward=_Scorer("detached"), max_steps=1, srp=False)
    with pytest.raises(ValueError, match="'scorer_detached'.*does not require grad"):
        trainer.train()


@pytest.mark.parametrize("kind", ["flux", "sd"])
@pytest.mark.parametrize("method", ["direct_align", "draft"])
def test_brightness_rises(tiny_model_dir, tmp_path, method, kind):
    """40 optimizer steps, LoRA: the rollout brightness of the first vs the last 10 steps (two logs each). Measured
    gains over seeds 0, 1, 42 and 1–2 threads: tiny FLUX (lr 1e-2) 0.09–0.10, round std ≤ 0.015; tiny SD1.5 (lr
    3e-2) 0.024–0.025 (0.019–0.020 at lr 1e-2), round std ≤ 0.0067."""
    learning_rate, margin = {"flux": (1e-2, 0.03), "sd": (3e-2, 0.01)}[kind]
    overrides = {
        "method": method,
        "srp": False,
        "max_steps": 40,
        "seed": LEARNING_SEED,
        "learning_rate": learning_rate,
    }
    trainer = _trainer(tiny_model_dir, tmp_path, kind=kind, **overrides)
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    noise = max(entry["reward_std"] for entry in trainer.state.log_history if "reward_std" in entry)
    assert_learned("brightness", sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2, noise, margin=margin)


def test_decoder_checkpointing_keeps_less_for_backward(tiny_model_dir):
    """benchmarks/direct_reward_memory.py's count on the tiny FLUX VAE (the README quotes its FLUX.1 figure)."""
    import os
    import sys

    from diffusers import DiffusionPipeline

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from direct_reward_memory import measure

    vae = DiffusionPipeline.from_pretrained(tiny_model_dir("flux")).vae
    saved = measure(vae, torch.randn(1, vae.config.latent_channels, 4, 4, requires_grad=True))
    assert 0 < saved["with"] * 4 < saved["without"]  # measured 11×


def test_resume_inside_a_round_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """A checkpoint after the first of a round's 4 updates resumes to the same LoRA, bit for bit."""
    train_and_resume(functools.partial(_trainer, tiny_model_dir), tmp_path / "run")


def test_full_fine_tune_trains_and_saves_the_denoiser(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, lora=False, max_steps=2)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    trainer.save_model()
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors").is_file()
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Direct-Align, σ from entries 5–25 of a 50-step schedule" in card and "srpo" in card


def test_sde_rollouts_as_srpo_samples(tiny_model_dir, tmp_path):
    """eta > 0: the rounds sample with DanceGRPO's SDE (SRPO's η 0.3) from the same ε, so their images differ from the
    deterministic sampler's; Direct-Align still re-noises each sample with its own ε and trains."""
    results = []
    for eta in (0.0, 0.3):
        trainer = _trainer(tiny_model_dir, tmp_path / str(eta), eta=eta, max_steps=1)
        trainer.train()
        results.append((trainer.rollout_plan(), trainer._rollout["x0"], trainer._rollout["noise"]))
    (ode_plan, ode_x0, ode_noise), (sde_plan, sde_x0, sde_noise) = results
    assert ode_plan.stored_steps == range(0) and len(sde_plan.stored_steps) == 5  # 6 steps, the last deterministic
    assert torch.equal(ode_noise, sde_noise) and not torch.allclose(ode_x0, sde_x0)
