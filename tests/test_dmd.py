"""DMDTrainer: DMD2's generator loss in closed form, zero gradient where student, fake score and teacher agree, the
fake score's own optimizer, exact resume, bad input, distillation toward the teacher and RTDMD's reward tilt."""

import copy
import dataclasses
import functools
import math

import pytest
import torch
from conftest import (
    LEARNING_SEED,
    LORA_TARGETS,
    PROMPTS,
    TINY_VIDEO_FRAMES,
    tiny_online_values,
    train_and_assert_reward_rose,
    train_and_resume,
)
from datasets import Dataset
from peft import LoraConfig
from PIL import Image

from trl_dance import DMDConfig, DMDTrainer
from trl_dance.forward_process import renoise_interval
from trl_dance.losses import consistency_loss, dmd_loss, gan_generator_loss
from trl_dance.preference_data import fitted_media
from trl_dance.sampling import RolloutPlan, sample_generators, solve, step_noise
from trl_dance.sde import dance_sigmas
from trl_dance.testing import save_tiny_pipeline
from trl_dance.testing.flux import tiny_flux2_klein_pipeline

ROWS = [{"prompt": p} for p in PROMPTS[:8] for _ in range(2)]


def dmd_config(output_dir, **overrides) -> DMDConfig:
    values = tiny_online_values(output_dir) | {
        "num_generations": 2,
        "generation_batch_size": 16,
        "per_device_train_batch_size": 8,  # 2 micro-batches, one student update per round
        "num_inference_steps": 2,
        "guidance_scale": 3.5,
        "teacher_guidance_scale": 3.5,
        "learning_rate": 1e-3,
        "fake_score_learning_rate": 1e-3,
    }
    return DMDConfig(**(values | overrides))


def _trainer(
    tiny_model_dir,
    tmp_path,
    kind="flux",
    reward="brightness",
    lora_init=True,
    alpha=8,
    lora=True,
    dataset=None,
    **overrides,
):
    peft = (
        LoraConfig(r=8, lora_alpha=alpha, target_modules=LORA_TARGETS, init_lora_weights=lora_init) if lora else None
    )
    teacher = overrides.pop("teacher_model", None)
    return DMDTrainer(
        tiny_model_dir(kind),
        reward,
        args=dmd_config(tmp_path, **overrides),
        train_dataset=dataset or Dataset.from_dict({"prompt": PROMPTS[:8]}),
        peft_config=peft,
        teacher_model=teacher,
    )


def _real_images(colour=(250, 250, 250), size=(48, 40)) -> Dataset:
    """The prompts with a real image each: one flat colour (not the tiny VAE's size: fitted to it)."""
    return Dataset.from_dict({"prompt": PROMPTS[:8], "image": [Image.new("RGB", size, colour)] * 8})


def test_dmd_loss_closed_form():
    """∂L/∂x_g = g/D with g = (x_f − x_r)/mean|x_g − x_r| per sample (descent moves x_g along x_r − x_f: toward the
    teacher's clean prediction, away from the fake score's); exactly 0 where they agree; the loss value ½·mean(g²)."""
    g = torch.Generator().manual_seed(0)
    generated, real, fake = (torch.randn(3, 4, 5, generator=g) for _ in range(3))
    x = generated.clone().requires_grad_(True)
    loss = dmd_loss(x, real, fake)
    loss.sum().backward()
    scale = (generated - real).abs().mean(dim=(1, 2), keepdim=True)
    expected = (fake - real) / scale
    torch.testing.assert_close(x.grad, expected / 20)
    torch.testing.assert_close(loss, 0.5 * (expected**2).mean(dim=(1, 2)))
    x.grad = None
    dmd_loss(x, real, real).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_renoise_interval_closed_form():
    """AC-DMD's re-noising of x_s = (1 − σ_s)·x0 + σ_s·ε to σ_t: x_t = (1 − σ_t)·x0 + (noise of std σ_t); its target
    u* is dx_t/dσ_t at fixed (x_s, n) (central difference); at σ_s = 0 it is flow matching's (x_t, n − x0)."""
    g = torch.Generator().manual_seed(0)
    x0, eps, n = (torch.randn(4, 3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    sigma_s, sigma_t = torch.tensor([0.9, 0.75, 0.5, 0.3], dtype=torch.float64), torch.tensor([0.95, 0.8, 0.9, 0.31])
    x_s = (1 - sigma_s.view(-1, 1, 1)) * x0 + sigma_s.view(-1, 1, 1) * eps
    x_t, target, sigma_ts = renoise_interval(x_s, n, sigma_s, sigma_t.double())
    a = ((1 - sigma_t.double()) / (1 - sigma_s)).view(-1, 1, 1)
    torch.testing.assert_close(x_t.double(), (1 - sigma_t.double()).view(-1, 1, 1) * x0 + a * sigma_s.view(-1, 1, 1) * eps + sigma_ts.double().view(-1, 1, 1) * n, rtol=1e-5, atol=1e-5)  # fmt: skip
    torch.testing.assert_close((a.flatten() * sigma_s) ** 2 + sigma_ts.double() ** 2, sigma_t.double() ** 2)
    h = 1e-4
    up, down = (renoise_interval(x_s, n, sigma_s, sigma_t.double() + d)[0].double() for d in (h, -h))
    torch.testing.assert_close(target.double(), (up - down) / (2 * h), rtol=1e-3, atol=1e-3)
    x_t, target, sigma_ts = renoise_interval(x0, n, torch.zeros(4), sigma_t)
    torch.testing.assert_close(x_t, ((1 - sigma_t).view(-1, 1, 1) * x0 + sigma_t.view(-1, 1, 1) * n).float())
    torch.testing.assert_close(target, (n - x0).float())
    torch.testing.assert_close(sigma_ts, sigma_t)


def test_consistency_loss_is_an_unbiased_squared_distance():
    """mean((h′₁ − h)(h′₂ − h)) over independent draws h′ ~ m + noise estimates (m − h)² (200,000 draws: within 1 %),
    and its gradient in h is (2h − h′₁ − h′₂)/D."""
    g = torch.Generator().manual_seed(0)
    anchor, mean = torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)
    first, second = (mean + torch.randn(200_000, 8, generator=g) for _ in range(2))
    estimate = consistency_loss(anchor.expand(200_000, 8), first, second).mean()
    assert abs(estimate / ((mean - anchor) ** 2).mean() - 1) < 0.01
    h = anchor.clone().requires_grad_(True)
    consistency_loss(h, first[:1], second[:1]).sum().backward()
    torch.testing.assert_close(h.grad, (2 * anchor - first[:1] - second[:1]) / 8)


def test_ac_dmd_is_dmd_at_the_last_step(tiny_model_dir, tmp_path):
    """At the last step (σ_s = 0) the student's CPS transition is its clean sample and the judges' steps back to σ_s
    are their clean predictions, so AC-DMD's loss and gradient are DMD's (the teacher's guidance 5 against the
    student's 3.5, so both are non-zero). Off the last step they differ."""
    trainers = {
        kind: _trainer(tiny_model_dir, tmp_path / kind, loss_type=kind, teacher_guidance_scale=5.0)
        for kind in ("dmd", "ac_dmd")
    }
    trainers["dmd"]._generate_and_score(ROWS)
    trainers["ac_dmd"].fake_score.load_state_dict(trainers["dmd"].fake_score.state_dict())  # (the round moved it)
    inputs = trainers["dmd"]._microbatch(trainers["dmd"]._microbatches[0])
    results = {}
    for step in (1, 0):  # the 2-step grid's last step, then its first
        inputs["step"] = torch.full_like(inputs["step"], step)
        for kind, trainer in trainers.items():
            trainer.model.zero_grad()
            loss = trainer.compute_loss(trainer.model, inputs)
            loss.backward()
            results[kind, step] = (
                loss.detach(),
                [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad],
            )
    (dmd, dmd_grads), (ac, ac_grads) = results["dmd", 1], results["ac_dmd", 1]
    assert dmd > 0
    torch.testing.assert_close(ac, dmd, rtol=1e-4, atol=0)
    for a, b in zip(ac_grads, dmd_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * max(g.abs().max() for g in dmd_grads).item())
    assert not torch.allclose(results["ac_dmd", 0][0], results["dmd", 0][0], rtol=1e-2)


def test_bad_ac_dmd_input_fails_at_construction(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"loss_type must be one of \['dmd', 'ac_dmd', 'rtdmd'\]"):
        dmd_config(tmp_path, loss_type="ac")
    with pytest.raises(ValueError, match="cps_eta must be in"):
        dmd_config(tmp_path, loss_type="ac_dmd", cps_eta=0.0)
    with pytest.raises(ValueError, match="must exceed the grid's second level"):
        _trainer(tiny_model_dir, tmp_path, loss_type="ac_dmd", dmd_sigma_max=0.7)  # the 2-step grid: σ = 1, 0.75, 0


@pytest.mark.parametrize("lora", [True, False])
def test_zero_gradient_when_student_fake_score_and_teacher_agree(tiny_model_dir, tmp_path, lora):
    """A zero-initialised LoRA (student = teacher; or full fine-tuning, the teacher a frozen copy), the fake score as it
    starts (a copy of the student) and the teacher's guidance equal to the student's: every trained gradient of the
    student's loss is exactly 0. After the round's fake updates moved the fake score, the same micro-batch has a
    gradient."""
    trainer = _trainer(tiny_model_dir, tmp_path, lora=lora)
    assert (trainer.ref_model is None) == lora
    start = copy.deepcopy(trainer.fake_score.state_dict())  # (on the CPU, state_dict's tensors are the live ones)
    trainer._generate_and_score(ROWS)
    moved = {name: value.detach().clone() for name, value in trainer.fake_score.params.items()}
    assert any(not torch.equal(moved[name], value) for name, value in start["params"].items())
    trainer.fake_score.load_state_dict(start)
    for item in trainer._microbatches:
        trainer.compute_loss(trainer.model, trainer._microbatch(item)).backward()
    grads = [p.grad for p in trainer.model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.abs().max() == 0 for g in grads)
    with torch.no_grad():
        for name, value in moved.items():
            trainer.fake_score.params[name].copy_(value)
    trainer.compute_loss(trainer.model, trainer._microbatch(trainer._microbatches[0])).backward()
    assert sum(p.grad.abs().sum() for p in trainer.model.parameters() if p.requires_grad) > 0


def test_fake_score_gradient_is_exact_under_activation_checkpointing(tiny_model_dir, tmp_path):
    """The fake score's forward and its backward both run with its tensors in place, so activation checkpointing's
    recomputation (in the backward) sees them too: its gradient equals the one without checkpointing. (A
    ``functional_call`` substitution ended with the forward; the recomputation then ran on the student's LoRA: 94 %
    of the gradient's entries were wrong.)"""
    trainer = _trainer(tiny_model_dir, tmp_path)
    fake, policy, generator = trainer.fake_score, trainer.policy, torch.Generator().manual_seed(0)
    with torch.no_grad():  # a fake score away from the student's (zero-initialised) LoRA
        for value in fake.params.values():
            value.add_(torch.randn(value.shape, generator=generator))
    latents = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(2)])
    cond, sigma = policy.encode_prompts(PROMPTS[:2]), torch.tensor([0.3, 0.7])

    def gradient(checkpointing: bool) -> torch.Tensor:
        toggle = "enable" if checkpointing else "disable"
        getattr(policy.denoiser, f"{toggle}_gradient_checkpointing")()
        with fake.in_place() as model:
            policy.predict(model, latents, cond, at=sigma).square().sum().backward()
        grads = torch.cat([value.grad.flatten() for value in fake.params.values()])
        fake.optimizer.zero_grad(set_to_none=True)
        return grads

    plain = gradient(False)
    assert plain.abs().max() > 0
    torch.testing.assert_close(gradient(True), plain, rtol=1e-5, atol=1e-6 * plain.abs().max().item())
    assert all(p.grad is None for p in trainer.model.parameters())  # the student's tensors took no part


def test_gan_generator_gradient_is_exact_under_activation_checkpointing(tiny_model_dir, tmp_path):
    """DMD2's GAN term reaches the student through its gradient in x_σ, taken with the fake score in place: with
    activation checkpointing, the student's gradient equals the direct one (no checkpointing, the loss
    w·softplus(−D(x_σ)) differentiated through the fake score and the head to the student). The DMD term is exactly 0
    here (zero-initialised LoRA, the fake score as it starts, the teacher's guidance the student's), so the GAN term is
    all of it."""
    trainer = _trainer(
        tiny_model_dir, tmp_path, dataset=_real_images(), gan_generator_weight=0.5, activation_checkpointing=True
    )
    start = copy.deepcopy(trainer.fake_score.state_dict()["params"])
    trainer._generate_and_score([row for row in trainer.train_dataset for _ in range(2)])  # builds, trains the head
    assert trainer.gan_head.layers is not None and len(trainer.fake_score.optimizer.param_groups) == 2
    trainer.fake_score.load_state_dict({"params": start, "optimizer": trainer.fake_score.optimizer.state_dict()})
    inputs = trainer._microbatch(trainer._microbatches[0])
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.compute_loss(trainer.model, inputs).backward()
    through_surrogate = [p.grad.clone() for p in trained]

    denoiser, policy = trainer.policy.denoiser, trainer.policy
    denoiser.disable_gradient_checkpointing()
    velocity = policy.predict(trainer.model, inputs["state"], inputs["cond"], at=inputs["step"])
    generated = trainer.process.predicted_clean(velocity, inputs["state"], inputs["step"])
    noisy = trainer.process.add_noise(generated, inputs["noise"], inputs["sigma"])
    with trainer.fake_score.in_place() as fake, trainer.gan_tap.capture() as features:
        policy.predict(fake, noisy, inputs["cond"], at=inputs["sigma"])
        direct = (0.5 * gan_generator_loss(trainer.gan_head(features[0]))).mean()
        expected = torch.autograd.grad(direct, trained)
    assert max(g.abs().max() for g in expected) > 0
    for got, want in zip(through_surrogate, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(g.abs().max() for g in expected).item())


# DMD2's classifier (weight 1, fake lr 1e-3, generator weight 0.05) over 20 rounds: its loss (mean of the last 3
# rounds) falls 0.200, 0.151, 0.177 below chance 2·ln 2 and the real − fake logit gap reaches 0.43, 0.32, 0.38 (seeds
# 42, 1, 2; from about 0 at the first round); margins <= the smallest / 2.3.
def test_gan_classifier_learns_the_real_images_from_the_students_samples(tiny_model_dir, tmp_path):
    trainer = _trainer(
        tiny_model_dir, tmp_path, dataset=_real_images(), gan_generator_weight=0.05, gan_discriminator_weight=1.0,
        max_steps=20, seed=LEARNING_SEED,
    )  # fmt: skip
    trainer.train()
    logs = [row for row in trainer.state.log_history if "dmd/gan_discriminator_loss" in row][-3:]
    loss = sum(row["dmd/gan_discriminator_loss"] for row in logs) / 3
    gap = sum(row["dmd/gan_real_logit"] - row["dmd/gan_fake_logit"] for row in logs) / 3
    print(f"classifier loss {loss:.4f} (chance {2 * math.log(2):.4f}), real - fake logit {gap:.4f}")
    assert loss < 2 * math.log(2) - 0.06 and gap > 0.14


def test_gan_reads_real_videos_for_a_video_family(tiny_model_dir, tmp_path):
    """Wan: the real column is `video` (frames fitted to the sampled size, the first `num_frames`), the head reads a
    WanTransformerBlock's tokens, and a round trains with finite classifier and generator losses."""
    frames = [Image.new("RGB", (40, 48), (250, 250, 250))] * (TINY_VIDEO_FRAMES + 2)
    dataset = Dataset.from_dict({"prompt": PROMPTS[:8], "video": [frames] * 8})
    trainer = _trainer(
        tiny_model_dir, tmp_path, kind="wan", dataset=dataset, gan_generator_weight=0.1, max_steps=1,
        num_frames=TINY_VIDEO_FRAMES, activation_checkpointing=True,
    )  # fmt: skip
    trainer.train()
    assert type(trainer.gan_tap.block).__name__ == "WanTransformerBlock" and trainer.gan_head.layers is not None
    (log,) = [row for row in trainer.state.log_history if "dmd/gan_generator_loss" in row]
    assert math.isfinite(log["dmd/gan_discriminator_loss"]) and math.isfinite(log["dmd/gan_generator_loss"])


def test_compiled_ac_dmd_with_the_gan_equals_eager(tiny_model_dir, tmp_path):
    """Compiled blocks (dynamo with the aot_eager backend: the same graphs and guards as inductor) with the fake score's
    tensors substituted in place and the GAN's tapped block eager: after a round of AC-DMD with the GAN and
    activation checkpointing, the student and the fake score equal the eager run's bit for bit, with no graph break."""
    from torch._dynamo.utils import counters

    runs = []
    for extra in ({}, {"torch_compile": True, "torch_compile_backend": "aot_eager"}):
        torch._dynamo.reset()
        counters.clear()
        trainer = _trainer(
            tiny_model_dir, tmp_path / str(len(runs)), dataset=_real_images(), gan_generator_weight=0.1,
            loss_type="ac_dmd", activation_checkpointing=True, max_steps=1, **extra,
        )  # fmt: skip
        trainer.train()
        runs.append([*trainer.fake_score.params.values(), *trainer.gan_head.parameters(), *trainer.model.parameters()])
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
    for eager, compiled in zip(*runs):
        assert torch.equal(eager, compiled)


def test_bad_gan_input_fails_at_construction(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="no column 'image'"):
        _trainer(tiny_model_dir, tmp_path, gan_generator_weight=0.1)
    with pytest.raises(ValueError, match="soundtrack together"):
        _trainer(tiny_model_dir, tmp_path, kind="ltx2", dataset=_real_images(), gan_generator_weight=0.1)
    with pytest.raises(ValueError, match="gan_feature_block=7 is out of range"):
        _trainer(tiny_model_dir, tmp_path, dataset=_real_images(), gan_generator_weight=0.1, gan_feature_block=7)
    with pytest.raises(ValueError, match="gan_discriminator_weight > 0"):
        dmd_config(tmp_path, gan_generator_weight=0.1, gan_discriminator_weight=0.0)
    with pytest.raises(ValueError, match="gan_generator_weight must be >= 0"):
        dmd_config(tmp_path, gan_generator_weight=-1.0)


def test_fitted_media_covers_and_centre_crops():
    """A 60×20 image fitted to 16×32 (H×W): scaled to cover (96×32), centre-cropped; a video keeps its first frames."""
    image = Image.new("RGB", (60, 20), (0, 0, 0))
    image.paste((255, 255, 255), (28, 0, 32, 20))  # a white stripe at the centre
    (fitted,) = fitted_media([image], 16, 32)
    assert fitted.shape == (3, 16, 32) and fitted.min() == -1
    assert fitted[:, :, 15:17].min() > 0.9 and fitted[:, :, :8].max() == -1
    # diffusers' own fitting (VaeImageProcessor, resize_mode="crop"), at sizes its default would round down to 8s
    from diffusers.image_processor import VaeImageProcessor

    reference = VaeImageProcessor(vae_scale_factor=1, resample="bilinear").preprocess(
        image, 20, 36, resize_mode="crop"
    )
    assert torch.equal(fitted_media([image], 20, 36), reference) and reference.shape == (1, 3, 20, 36)
    video = fitted_media([[image, image, Image.new("RGB", (60, 20))]], 16, 32, num_frames=2)
    assert video.shape == (1, 2, 3, 16, 32) and torch.equal(video[0, 0], fitted)
    with pytest.raises(ValueError, match="fewer than num_frames=4"):
        fitted_media([[image]], 16, 32, num_frames=4)
    with pytest.raises(ValueError, match="value 0: the image"):
        fitted_media([None], 16, 32)


def test_gan_resume_restores_the_head_and_its_optimizer_exactly(tiny_model_dir, tmp_path):
    make = functools.partial(_trainer, tiny_model_dir, dataset=_real_images(), gan_generator_weight=0.5)
    full, resumed = train_and_resume(make, tmp_path / "run")
    for (name, value), other in zip(full.gan_head.state_dict().items(), resumed.gan_head.state_dict().values()):
        assert torch.equal(value, other), name
    a, b = full.fake_score.optimizer.state_dict()["state"], resumed.fake_score.optimizer.state_dict()["state"]
    assert len(a) == len(b) == len(full.fake_score.params) + 6  # the head: a LayerNorm and two linear layers
    assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in a)


def test_a_teacher_from_another_checkpoint_starts_the_fake_score(tiny_model_dir, tmp_path):
    """`teacher_model_name_or_path` loads only the other checkpoint's denoiser as the teacher (its weights, not the
    student's base), with the student's LoRA layout zeroed; the fake score runs on it and starts as it, so the student's
    first gradient is exactly 0 although the student predicts otherwise. A denoiser instance serves as well; another
    family's is refused."""
    from diffusers import FluxTransformer2DModel

    other = save_tiny_pipeline("flux", str(tmp_path / "teacher"), seed=1)
    trainer = _trainer(tiny_model_dir, tmp_path / "run", teacher_model_name_or_path=other, teacher_guidance_scale=3.5)
    teacher, student = trainer.ref_model, trainer.policy.denoiser
    assert trainer.fake_score.module is teacher and teacher is not student
    saved = FluxTransformer2DModel.from_pretrained(other, subfolder="transformer")
    assert torch.equal(teacher.x_embedder.weight, saved.x_embedder.weight)
    assert not torch.equal(student.x_embedder.weight, saved.x_embedder.weight)
    start = copy.deepcopy(trainer.fake_score.state_dict())
    trainer._generate_and_score(ROWS)
    trainer.fake_score.load_state_dict(start)
    inputs = trainer._microbatch(trainer._microbatches[0])
    with torch.no_grad():
        ours = trainer.policy.predict(trainer.model, inputs["state"], inputs["cond"], at=inputs["sigma"])
        theirs = trainer.reference_prediction(trainer.model, inputs["state"], inputs["cond"], inputs["sigma"])
    assert (ours - theirs).abs().max() > 1e-2
    trainer.compute_loss(trainer.model, inputs).backward()
    assert all(p.grad.abs().max() == 0 for p in trainer.model.parameters() if p.requires_grad)
    # Its adapter's A (the fake score's start) is the student's initial A, drawn from the seed whatever the global
    # generator held before (unseeded, two runs of one seed started their fake scores apart).
    lora_a = {n: p for n, p in teacher.named_parameters() if ".lora_A." in n}
    assert lora_a and all(torch.equal(p, trainer.fake_score.params[n]) for n, p in lora_a.items())
    torch.manual_seed(12345)
    instance = _trainer(tiny_model_dir, tmp_path / "instance", teacher_model=saved)
    assert instance.ref_model is saved
    student = dict(instance.model.named_parameters())
    assert all(
        torch.equal(p, lora_a[n]) and torch.equal(p, student[n]) for n, p in saved.named_parameters() if n in lora_a
    )
    with pytest.raises(ValueError, match="teacher_model must be a FluxTransformer2DModel"):
        _trainer(tiny_model_dir, tmp_path / "sd3", teacher_model_name_or_path=tiny_model_dir("sd3"))


def test_a_base_teacher_runs_its_cfg_for_a_step_distilled_student(tmp_path):
    """RTDMD's FLUX.2 [klein] cold start: the student's pipeline is step-distilled (no CFG), the teacher the base
    checkpoint; the teacher's steps run through the trained pipeline with the base's own settings, so its guidance 4
    is true CFG: its prediction equals the base pipeline's own policy's."""
    from trl_dance.policies import SamplerSettings, make_policy
    from trl_dance.trainer.diffusion_trainer import load_pipeline

    student, base = str(tmp_path / "distilled"), str(tmp_path / "base")
    tiny_flux2_klein_pipeline(0, is_distilled=True).save_pretrained(student)
    tiny_flux2_klein_pipeline(0, is_distilled=False).save_pretrained(base)
    args = dmd_config(
        tmp_path / "run", guidance_scale=1.0, teacher_guidance_scale=4.0, teacher_model_name_or_path=base
    )
    trainer = DMDTrainer(student, "brightness", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}))
    assert trainer._teacher_policy.use_cfg and not trainer.policy.use_cfg
    assert trainer.policy.pipeline.config["is_distilled"]  # (the trained pipeline itself is left as it was)
    own = make_policy(load_pipeline(base, args), SamplerSettings.from_config(args))
    own = make_policy(own.pipeline, dataclasses.replace(own.settings, guidance_scale=4.0))
    latents = own.initial_noise([torch.Generator().manual_seed(i) for i in range(2)])
    sigma = torch.tensor([0.4, 0.8])
    with torch.no_grad():
        theirs = own.predict(own.denoiser, latents, own.encode_prompts(PROMPTS[:2]), at=sigma)
        ours = trainer.reference_prediction(
            trainer.model, latents, trainer._teacher_policy.encode_prompts(PROMPTS[:2]), sigma, trainer._teacher_policy
        )
    torch.testing.assert_close(ours, theirs)


def test_rounds_record_the_students_states_and_update_the_fake_score_apart(tiny_model_dir, tmp_path):
    """The round's rollout records every one of the student's steps; the fake score is not in the Trainer's optimizer
    and makes `fake_score_updates` AdamW steps per round; the student makes one optimizer update per round; the state
    a student item trains at is the recorded one; no advantage statistics are logged."""
    trainer = _trainer(tiny_model_dir, tmp_path, fake_score_updates=3, max_steps=2)
    assert trainer.rollout_plan().recorded_steps == (0, 1)
    trainer.train()
    fake = {id(p) for p in trainer.fake_score.params.values()}
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert fake and not fake & trained
    steps = {state["step"].item() for state in trainer.fake_score.optimizer.state.values()}
    assert steps == {6.0} and trainer.state.global_step == 2
    logged = set().union(*trainer.state.log_history)  # no group statistics where nothing trains on advantages
    assert "reward" in logged and not logged & {"frac_reward_zero_std", "advantages/abs_mean"}
    item = trainer._microbatches[0]
    inputs = trainer._microbatch(item)
    assert torch.equal(inputs["state"], trainer._rollout["visited"][item[0], item[1]])
    assert set(trainer._rollout["visited"].shape[:2]) == {16, 2}


def test_resume_restores_the_fake_score_and_its_optimizer_exactly(tiny_model_dir, tmp_path):
    full, resumed = train_and_resume(functools.partial(_trainer, tiny_model_dir), tmp_path / "run")
    for name, value in full.fake_score.params.items():
        assert torch.equal(value, resumed.fake_score.params[name]), name
    a, b = full.fake_score.optimizer.state_dict()["state"], resumed.fake_score.optimizer.state_dict()["state"]
    assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in a)


def test_bad_dmd_input_fails_at_construction(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="velocity predictions"):
        _trainer(tiny_model_dir, tmp_path, kind="sd")
    with pytest.raises(ValueError, match="beta > 0 does not apply"):
        dmd_config(tmp_path, beta=0.1)
    with pytest.raises(ValueError, match="fake_score_updates must be >= 1"):
        dmd_config(tmp_path, fake_score_updates=0)
    with pytest.raises(ValueError, match="dmd_sigma_min < dmd_sigma_max"):
        dmd_config(tmp_path, dmd_sigma_min=0.5, dmd_sigma_max=0.4)
    with pytest.raises(ValueError, match="num_iterations must be 1"):  # (it was an IndexError in the second pass)
        dmd_config(tmp_path, num_iterations=2)
    distilled = str(tmp_path / "klein-distilled")
    tiny_flux2_klein_pipeline(0, is_distilled=True).save_pretrained(distilled)
    with pytest.raises(ValueError, match="teacher_guidance_scale=4.0 has no effect on Flux2KleinPipeline"):
        DMDTrainer(distilled, "brightness", args=dmd_config(tmp_path, teacher_guidance_scale=4.0, guidance_scale=1.0),
                   train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}))  # fmt: skip
    with pytest.raises(ValueError, match="only return floats"):
        _trainer(tiny_model_dir, tmp_path, reward=lambda prompts, images, **_: [0.0] * len(prompts), reward_tilt=1.0)


def _rtdmd(tiny_model_dir, tmp_path, **overrides) -> DMDTrainer:
    """RTDMD's stage 2 on the tiny FLUX: a 3-step CPS student, PPO on both of its stochastic steps (unless overridden),
    groups of 4."""
    values = {"loss_type": "rtdmd", "num_inference_steps": 3, "policy_gradient_steps": 2, "num_generations": 4}
    return _trainer(tiny_model_dir, tmp_path, **(values | overrides))


def test_rtdmd_trains_each_sample_on_the_rounds_ppo_steps_and_its_last_step_on_policy(tiny_model_dir, tmp_path):
    """RTDMD's stage 2: each sample is an item at its deterministic last step (DMD) and at each of the round's PPO
    steps, which are the same for every sample and drawn from (seed, round), in micro-batches of one kind; the PPO
    items' recomputed CPS log-probabilities (RTDMD's pseudo log-probability) equal the rollout's (ratio 1 on-policy), and a PPO micro-batch's gradient
    is exactly 0 at zero advantages (whatever the DMD weight), not with the round's."""
    trainer = _rtdmd(tiny_model_dir, tmp_path, policy_gradient_steps=1)
    rows = [{"prompt": p} for p in PROMPTS[:4] for _ in range(4)]
    trainer._generate_and_score(rows)
    items = trainer._microbatches
    assert trainer.args.gradient_accumulation_steps == len(items) == 4  # 16 samples × 2 items / 8: one update
    steps = torch.cat([item[1] for item in items])
    samples = torch.cat([item[0] for item in items])
    chosen = {int(s) for s in steps if s != 2}
    assert (
        len(chosen) == 1
        and chosen <= {0, 1}
        and (steps == 2).sum() == 16
        and sorted(samples.tolist()) == sorted(list(range(16)) * 2)
    )
    assert all(len(set((item[1] == 2).tolist())) == 1 for item in items)  # micro-batches of one kind
    assert trainer._policy_gradient_steps(0).tolist() == sorted(chosen)  # (seed, round) decide
    ppo = [trainer._microbatch(item) for item in items if item[1][0] < 2]
    assert len(ppo) == 2
    for inputs in ppo:
        with torch.no_grad():
            v = trainer.policy.predict(trainer.model, inputs["state"], inputs["cond"], at=inputs["step"])
            step = trainer.policy.step(v, inputs["state"], inputs["step"], prev_sample=inputs["next_state"])
        assert (step.log_prob - inputs["old_log_prob"]).abs().max() < 1e-5
        # RTDMD's pseudo log-probability −mean((x′ − μ)²), not the Gaussian's (no 1/(2·std²), no normaliser)
        pseudo = -((inputs["next_state"].float() - step.mean) ** 2).flatten(1).mean(1)
        torch.testing.assert_close(step.log_prob, pseudo, rtol=0, atol=0)

    inputs = ppo[0]

    def gradient(advantages: torch.Tensor, weight: float) -> torch.Tensor:
        trainer.args.distribution_matching_weight = weight
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, inputs | {"advantages": advantages}).backward()
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.requires_grad])

    assert gradient(torch.zeros_like(inputs["advantages"]), 1.0).abs().max() == 0  # (DMD's items are apart)
    assert gradient(inputs["advantages"], 1.0).abs().max() > 0


def test_rtdmd_groups_share_their_noise_at_the_steps_ppo_does_not_train(tiny_model_dir, tmp_path):
    """RTDMD's rollouts: a group's samples draw the same noise at the stochastic steps the round does not train and
    their own at the trained one, so a group's states agree up to its first trained step and differ after it."""
    trainer = _rtdmd(tiny_model_dir, tmp_path, num_inference_steps=4, policy_gradient_steps=1)
    plan, trained = trainer.rollout_plan(0), trainer._policy_gradient_steps(0).tolist()
    assert sorted([*plan.group_noise_steps, *trained]) == [0, 1, 2]
    groups = [0] * 4 + [1] * 4
    noise = step_noise(plan, sample_generators(0, 0, 0, 8), (3, 5), groups)
    for step in range(3):
        same = all(torch.equal(noise[step, i], noise[step, 4 * (i // 4)]) for i in range(8))
        assert same == (step in plan.group_noise_steps) and not torch.equal(noise[step, 0], noise[step, 4])
    trainer._generate_and_score([{"prompt": p} for p in PROMPTS[:4] for _ in range(4)])
    visited, first = trainer._rollout["visited"], trained[0]
    for k in range(first + 1):  # (the initial noise is shared too)
        assert all(torch.equal(visited[i, k], visited[4 * (i // 4), k]) for i in range(16))
    assert not torch.equal(visited[0, first + 1], visited[1, first + 1])


def test_rtdmd_resumes_exactly(tiny_model_dir, tmp_path):
    full, resumed = train_and_resume(functools.partial(_rtdmd, tiny_model_dir), tmp_path / "run")
    for name, value in full.fake_score.params.items():
        assert torch.equal(value, resumed.fake_score.params[name]), name


def test_defaults_follow_the_loss_type(tmp_path):
    """RTDMD's PPO trains on group advantages beside 1e-3 x DMD's loss; DMD's advantages only monitor. (RTDMD on
    DMD's "none" and weight 1 lost its reward: 67-109 first-round stds in 24 rounds, #76 measured.)"""
    values = {"num_generations": 4, "num_inference_steps": 3}
    rtdmd, dmd = dmd_config(tmp_path, loss_type="rtdmd", **values), dmd_config(tmp_path, **values)
    assert (rtdmd.scale_rewards, rtdmd.distribution_matching_weight) == ("group", 1e-3)
    assert (dmd.scale_rewards, dmd.distribution_matching_weight) == ("none", 1.0)
    chosen = dmd_config(tmp_path, loss_type="rtdmd", scale_rewards="batch", distribution_matching_weight=0.5, **values)
    assert (chosen.scale_rewards, chosen.distribution_matching_weight) == ("batch", 0.5)


def test_the_fake_score_learns_on_its_own_sigma_range(tiny_model_dir, tmp_path):
    """fake_score_sigma_min/max (DMD2's full range, or any): the fake score's forwards see σ only there; unset, the
    DMD range."""
    default = dmd_config(tmp_path)
    assert (default.fake_score_sigma_min, default.fake_score_sigma_max) == (0.02, 0.98)
    with pytest.raises(ValueError, match="need 0 <= fake_score_sigma_min < fake_score_sigma_max <= 1"):
        dmd_config(tmp_path, fake_score_sigma_min=0.5, fake_score_sigma_max=0.5)
    trainer = _trainer(tiny_model_dir, tmp_path, fake_score_sigma_min=0.0, fake_score_sigma_max=0.1)
    trainer._generate_and_score([{"prompt": p} for p in PROMPTS[:8] for _ in range(2)])
    seen, predict = [], trainer.policy.predict

    def recording(model, latents, cond, at):
        seen.append(at.detach().clone())
        return predict(model, latents, cond, at=at)

    trainer.policy.predict = recording
    trainer._update_fake_score()
    seen = torch.cat(seen)
    assert len(seen) == 16 and seen.min() >= 0 and seen.max() <= 0.1


def test_bad_rtdmd_input_fails_at_construction(tmp_path):
    values = {"loss_type": "rtdmd", "num_inference_steps": 3}
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        dmd_config(tmp_path, **values, num_generations=1, generation_batch_size=8, per_device_train_batch_size=8)
    with pytest.raises(ValueError, match=r"policy_gradient_steps must be in \[1, 2\]"):
        dmd_config(tmp_path, **values, policy_gradient_steps=3)
    with pytest.raises(ValueError, match=r"epsilon must be in \(0, 1\)"):
        dmd_config(tmp_path, **values, epsilon=0.0)
    with pytest.raises(ValueError, match="micro-batches of one kind"):  # (36 items, but 12 samples)
        dmd_config(tmp_path, **values, num_generations=4, generation_batch_size=12, per_device_train_batch_size=9)


# RTDMD's stage 2 in RTDMD's shape (a 4-step CPS student, PPO on 2 of its 3 stochastic steps, the third's noise shared
# by each group of 4; DMD weight 1e-3, lr 1e-2, 20 rounds): brightness gains 0.086, 0.048, 0.069 over seeds 42, 1, 2
# (first-round std 0.004-0.007). With 3 steps (PPO on both): 0.058, 0.056, 0.068, against 0.013 for AC-DMD alone at
# the same lr and 0.002 at DMD weight 1 (the teacher's pull dominating). Margin = smallest / 2.3.
@pytest.mark.slow
def test_rtdmd_policy_gradient_raises_the_reward(tiny_model_dir, tmp_path):
    trainer = _rtdmd(
        tiny_model_dir, tmp_path, num_inference_steps=4, learning_rate=1e-2, max_steps=20, seed=LEARNING_SEED
    )
    train_and_assert_reward_rose(trainer, "brightness", 0.021)


def _moment_distance(trainer) -> float:
    """How far the student's 2-step samples are from the teacher's: per prompt, the per-element mean and standard
    deviation over 8 noises of its final latents against those of the teacher's 8-step Euler ODE (the base, the
    teacher's guidance, the shift-3 grid), squared differences averaged. Distribution matching targets exactly these
    marginal statistics (not which noise maps where)."""
    prompts, noises = PROMPTS[:8], 8
    rows = [p for p in prompts for _ in range(noises)]
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(len(rows))]
    cond = trainer.policy.encode_prompts(rows)
    start = trainer.policy.initial_noise(generators)
    with torch.no_grad():
        student = trainer.sample(rows, generators, model=trainer.model, cond=cond, initial_noise=start,
                                 plan=RolloutPlan.deterministic(2))["final_latents"]  # fmt: skip
        layers = [] if trainer.ref_model is not None else trainer._reference_toggle(trainer.model)[1]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            grid = tuple(dance_sigmas(8, 3.0).tolist())
            teacher_model = trainer.ref_model if trainer.ref_model is not None else trainer.policy.denoiser
            teacher = solve(trainer._teacher_policy, teacher_model, start, cond, grid)
        finally:
            for layer in layers:
                layer.enable_adapters(True)
    student, teacher = (x.view(len(prompts), noises, -1).float() for x in (student, teacher))
    return float(((student.mean(1) - teacher.mean(1)) ** 2).mean() + ((student.std(1) - teacher.std(1)) ** 2).mean())


# Distillation toward the teacher, in the moment distance of the student's 2-step ODE samples to the teacher's 8-step
# ODE (lr 1e-3 both; seeds 42, 1, 2; bounds <= 1 − the smallest gain / 2.3):
# - "dmd": a student LoRA initialised at random (peft's init_lora_weights=False, α 8) starts off the teacher; DMD brings
#   it to 0.45, 0.35, 0.37 of the start in 30 rounds. At tiny scale a 2-step sampler of the random teacher is already within 0.0025
#   of its 8-step one, so the test distils a perturbed student back rather than a base one down in steps.
# - "ac_dmd": AC-DMD (RTDMD's stage 1, CPS η 0.9) on the same perturbed student: 0.49, 0.49, 0.41 in 20 rounds (0.72,
#   0.51, 0.47 in 30: seed 42 wanders back between). ODE samples: 2-step
#   CPS samples sit 0.30 from the teacher's 8-step ODE even for the zero-initialised student (that sampler's own error).
# - "other_teacher": a zero-initialised student toward a teacher from another checkpoint (the tiny FLUX saved with seed
#   1): 0.818, 0.826, 0.817 in 30 rounds, against 0.985 when distilled from its own base instead (in 20 rounds
#   0.89-0.91: too close to that for a test).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "rounds", "bound"), [("dmd", 30, 0.6), ("ac_dmd", 20, 0.78), ("other_teacher", 30, 0.92)]
)
def test_dmd_brings_the_student_toward_its_teacher(tiny_model_dir, tmp_path, case, rounds, bound):
    if case == "other_teacher":
        overrides = {"teacher_model_name_or_path": save_tiny_pipeline("flux", str(tmp_path / "teacher"), seed=1)}
    else:
        overrides = {"lora_init": False, "loss_type": case}
    trainer = _trainer(tiny_model_dir, tmp_path / "run", max_steps=rounds, seed=LEARNING_SEED, **overrides)
    before = _moment_distance(trainer)
    trainer.train()
    after = _moment_distance(trainer)
    print(f"moment distance to the teacher {before:.4f} -> {after:.4f}")
    assert after < bound * before


# Reward-tilted DMD (reward_tilt 1, student lr 3e-3, 30 rounds): brightness gains 0.049, 0.045, 0.029 over seeds 42,
# 1, 2 (first-round std 0.005-0.007), against -0.003 without the tilt; margin <= the smallest / 2.3.
@pytest.mark.slow
def test_reward_tilt_raises_the_reward(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, reward_tilt=1.0, learning_rate=3e-3, max_steps=30, seed=LEARNING_SEED)
    train_and_assert_reward_rose(trainer, "brightness", 0.012)


def test_reward_tilt_hinge_has_no_reward_gradient_above_its_margin(tiny_model_dir, tmp_path):
    """RTDMD's hinge `reward_tilt` × relu(margin − reward): with every reward above the margin the student's gradient is
    plain DMD's; with every reward below it, the linear tilt's (relu(m − r) = m − r), which differs."""
    trainer = _trainer(tiny_model_dir, tmp_path, reward_tilt=1.0)
    trainer._generate_and_score(ROWS)
    inputs = trainer._microbatch(trainer._microbatches[0])

    def gradient(tilt: float, margin: float | None) -> torch.Tensor:
        trainer.args.reward_tilt, trainer.args.reward_tilt_margin = tilt, margin
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, inputs).backward()
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.requires_grad])

    plain, linear = gradient(0.0, None), gradient(1.0, None)  # (brightness is in [0, 1])
    assert (linear - plain).abs().max() > 1e-3 * linear.abs().max()
    torch.testing.assert_close(gradient(1.0, -10.0), plain)
    torch.testing.assert_close(gradient(1.0, 10.0), linear)


def test_a_distilled_student_trains_on_with_its_lora_merged(tiny_model_dir, tmp_path):
    """RTDMD's second stage starts from the distilled student: `merge_lora` fuses a saved student LoRA into the base,
    after which the policy (a fresh LoRA, zero-initialised) samples exactly as the pipeline with the student's LoRA
    loaded; the LoRA-disabled reference is the merged student."""
    from conftest import tiny_grpo_config

    from trl_dance import DanceGRPOTrainer
    from trl_dance.trainer.diffusion_trainer import load_tiny_pipeline

    student = _trainer(tiny_model_dir, tmp_path / "dmd", lora_init=False, max_steps=1)
    student.train()
    student.save_model(str(tmp_path / "student"))
    grpo = DanceGRPOTrainer(
        tiny_model_dir("flux"), "brightness",
        args=tiny_grpo_config(tmp_path / "grpo", merge_lora=[str(tmp_path / "student")], guidance_scale=3.5),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS),
    )  # fmt: skip
    pipeline = load_tiny_pipeline(tiny_model_dir("flux"))
    pipeline.load_lora_weights(str(tmp_path / "student"), weight_name="pytorch_lora_weights.safetensors")
    prompts, generators = PROMPTS[:2], lambda: [torch.Generator().manual_seed(i) for i in range(2)]  # noqa: E731
    plan = RolloutPlan.deterministic(grpo.policy.num_steps)
    ours = grpo.sample(prompts, generators(), model=grpo.model, plan=plan)["final_latents"]
    base = DanceGRPOTrainer(
        pipeline, "brightness", args=tiny_grpo_config(tmp_path / "ref", guidance_scale=3.5),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
    )  # fmt: skip
    expected = base.sample(prompts, generators(), model=base.model, plan=plan)["final_latents"]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the fresh LoRA off: the merged student itself; and the student's LoRA changes samples
        reference = grpo.reference_prediction(grpo.model, ours, grpo.policy.encode_prompts(prompts), 3)
        unmerged = grpo.policy.predict(grpo.model, ours, grpo.policy.encode_prompts(prompts), at=3)
    torch.testing.assert_close(reference, unmerged, rtol=0, atol=0)
    untouched = DanceGRPOTrainer(
        tiny_model_dir("flux"), "brightness", args=tiny_grpo_config(tmp_path / "plain", guidance_scale=3.5),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
    )  # fmt: skip
    plain = untouched.sample(prompts, generators(), model=untouched.model, plan=plan)["final_latents"]
    assert (plain - expected).abs().max() > 1e-3
    with pytest.raises(FileNotFoundError, match="merge_lora: no pytorch_lora_weights"):
        DanceGRPOTrainer(tiny_model_dir("flux"), "brightness", args=tiny_grpo_config(tmp_path / "x", merge_lora=[str(tmp_path)]),
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}))  # fmt: skip


def test_a_two_step_student_is_evaluated_and_shown_on_its_training_grid(tiny_model_dir, tmp_path, capsys):
    """The run saves how its student samples (steps, the shifted `dance` σ grid, guidance, size); `trl-dance eval`
    with no sampling flag samples on that grid, and the card's snippet passes it to diffusers unshifted."""
    from trl_dance.scripts import evaluate
    from trl_dance.trainer.evaluation import SAMPLING_FILE, read_sampling_record

    trainer = _trainer(tiny_model_dir, tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model()
    record = read_sampling_record(trainer.args.output_dir)
    grid = dance_sigmas(2, trainer.args.shift).tolist()
    assert record["num_inference_steps"] == 2 and record["sigma_schedule"] == "dance"
    assert record["sigmas"] == [round(value, 6) for value in grid[:-1]] and grid[1] != 0.5  # (shifted)
    with open(tmp_path / "README.md") as handle:
        card = handle.read()
    assert f"sigmas={record['sigmas']}" in card and "shift=1.0, use_dynamic_shifting=False" in card
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    capsys.readouterr()
    arguments = ["--model_name_or_path", tiny_model_dir("flux"), "--prompts_file", str(prompts),
                 "--reward_funcs", "brightness", "--output_dir", str(tmp_path / "eval")]  # fmt: skip
    evaluate.main([*arguments, "--checkpoints", trainer.args.output_dir])
    shown = "(" + ", ".join(f"{value:.4g}" for value in grid) + ")"
    assert f"2 steps, guidance 3.5, 32×32, dance σ grid {shown}" in capsys.readouterr().out
    evaluate.main([*arguments, "--checkpoints", trainer.args.output_dir, "--sampling", "pipeline"])
    assert "8 steps" in capsys.readouterr().out and SAMPLING_FILE  # the pipeline's (the tiny folder's) defaults


@pytest.mark.parametrize("simulation", ["ode", "renoise"])
def test_backward_simulation_renoises_each_clean_prediction_with_fresh_noise(
    tiny_model_dir, tmp_path, capsys, simulation
):
    """DMD2's backward simulation: every visited state after the first is the previous state's clean prediction
    re-noised with fresh noise, x_{k+1} = (1 − σ_{k+1})·x̂0_k + σ_{k+1}·ε with ε standard normal and unrelated to the
    model's own noise estimate ε̂_k = (x_k − (1 − σ_k)·x̂0_k)/σ_k; on the deterministic (Euler) sampler ε is ε̂_k
    exactly. The student is evaluated, recorded and shown in its card with the sampler it trains with."""
    trainer = _trainer(tiny_model_dir, tmp_path, num_inference_steps=4, backward_simulation=simulation)
    trainer._generate_and_score(ROWS)
    visited, clean = trainer._rollout["visited"].float(), trainer._rollout["visited_clean"].float()
    sigmas = trainer.policy.process.sigma_values
    for k in range(3):  # the steps onto σ > 0
        noise = (visited[:, k + 1] - (1 - sigmas[k + 1]) * clean[:, k]) / sigmas[k + 1]
        estimate = (visited[:, k] - (1 - sigmas[k]) * clean[:, k]) / sigmas[k]
        if simulation == "ode":
            torch.testing.assert_close(noise, estimate, atol=1e-4, rtol=1e-4)
            continue
        correlation = torch.corrcoef(torch.stack([noise.flatten(), estimate.flatten()]))[0, 1]
        assert abs(noise.mean()) < 0.05 and abs(noise.std() - 1) < 0.05 and abs(correlation) < 0.1, k
    renoise = simulation == "renoise"
    assert (trainer._eval_plan(trainer.policy).sde_end > 0) == renoise
    assert trainer._sampling_record().get("stochastic_sampling", False) == renoise
    from trl_dance.trainer.evaluation import sampling_call_code

    code = sampling_call_code(trainer._sampling_record(), trainer.policy.pipeline)
    assert ("stochastic_sampling=True" in code) == renoise
    if renoise:
        with pytest.raises(ValueError, match="set cps_eta=1 for fresh noise"):
            dmd_config(tmp_path, loss_type="ac_dmd", backward_simulation="renoise")
        from trl_dance.scripts import evaluate

        trainer.save_model()  # `trl-dance eval` samples the saved student with fresh noise at each step too
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("a cat\n")
        capsys.readouterr()
        evaluate.main(["--model_name_or_path", tiny_model_dir("flux"), "--prompts_file", str(prompts),
                       "--output_dir", str(tmp_path / "eval"), "--checkpoints", trainer.args.output_dir])  # fmt: skip
        assert "'stochastic_sampling': True" in capsys.readouterr().out
