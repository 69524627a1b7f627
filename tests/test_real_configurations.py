"""Training in the configurations users run: bf16 pipelines with fp32 trainable weights, the schedulers and prediction
types the real checkpoints ship, and what the rollout hands to the rewards."""

import os
from pathlib import Path

import pytest
import torch
from conftest import LORA_TARGETS, PROMPTS, family_overrides, tiny_grpo_config, tiny_online_values
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer


def _rows(prompts, generations=4):
    return [{"prompt": p} for p in prompts for _ in range(generations)]


@pytest.mark.parametrize("kind", ["flux", "sd", "ltx2", "minimax-h3"])
def test_bf16_pipeline_trains_fp32_lora_weights(tiny_model_dir, tmp_path, kind):
    """A pipeline loaded in bf16 (as every real GRPO config loads it) trains its LoRA in fp32 under bf16 autocast:
    one Adam update at lr 1e-5 moves every entry (in bf16 most of them would round away), the base stays bf16 (but
    for the modules its class keeps in fp32: MiniMax-H3's patch projections, heads and time embedder, as shipped)."""
    args = tiny_grpo_config(
        tmp_path,
        bf16=True,
        model_init_kwargs={"dtype": "bfloat16"},
        learning_rate=1e-5,
        max_steps=1,
        gradient_accumulation_steps=5,  # the round's 5 micro-batches: one update
        guidance_scale=3.5 if kind == "flux" else 1.0,
        **family_overrides(kind),
    )
    # Both LoRA matrices random (not B = 0), so every entry has a gradient in the first update.
    # (MiniMax-H3: a handful of the text refiner's 768 query/key LoRA entries do not move on these few-token prompts,
    # 7 in bf16 and 9 in fp32: not rounding; the refiner is left out.)
    excluded = r".*token_refiner.*" if kind == "minimax-h3" else None
    lora = LoraConfig(
        r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False, exclude_modules=excluded
    )
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    trainer = DanceGRPOTrainer(tiny_model_dir(kind), "brightness", args=args, train_dataset=dataset, peft_config=lora)
    trained = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name and p.dtype == torch.float32 for name, p in trained.items())
    kept = type(trainer.policy.denoiser)._keep_in_fp32_modules or []
    frozen = {name: p for name, p in trainer.model.named_parameters() if not p.requires_grad}
    assert all(p.dtype == torch.bfloat16 for name, p in frozen.items() if not any(k in name for k in kept))
    assert all(p.dtype == torch.float32 for name, p in frozen.items() if any(k in name for k in kept))
    before = {name: p.detach().clone() for name, p in trained.items()}
    trainer.train()
    assert trainer.state.global_step == 1
    moved = torch.cat([(p.detach() != before[name]).flatten() for name, p in trained.items()])
    print(f"{moved.float().mean().item():.4f} of {moved.numel()} LoRA entries moved")
    assert moved.float().mean() > 0.999


@pytest.mark.parametrize("kind", ["flux", "sd3", "sd", "wan"])
def test_rewarded_sample_is_the_last_steps_deterministic_result(tiny_model_dir, tmp_path, kind):
    """The last step (never trained) is the deterministic step by default: for flow models its result is exactly the
    predicted clean sample x̂0 = x − σ v (DanceGRPO), so no sampling noise reaches the reward; ``last_step_sde``
    keeps the SDE sample (Flow-GRPO). The other steps' noise is the same either way."""
    overrides = {"num_frames": 5} if kind == "wan" else {}
    trainers = {
        sde: DanceGRPOTrainer(
            tiny_model_dir(kind),
            "brightness",
            args=tiny_grpo_config(tmp_path, last_step_sde=sde, guidance_scale=1.0, **overrides),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )
        for sde in (False, True)
    }
    rollouts = {}
    for sde, trainer in trainers.items():
        generators = [torch.Generator().manual_seed(i) for i in range(2)]
        rollouts[sde] = trainer.sample(PROMPTS[:2], generators)
    latents = rollouts[False]["latents"]
    torch.testing.assert_close(rollouts[True]["latents"], latents, rtol=0, atol=0)
    final = rollouts[False]["final_latents"]
    assert (rollouts[True]["final_latents"] - final).abs().max() > 1e-3

    policy = trainers[False].policy
    last = policy.num_steps - 1
    index = torch.full((2,), last)
    cond = policy.encode_prompts(PROMPTS[:2])
    with torch.no_grad():
        output = policy.predict(trainers[False].model, latents[:, last], cond, at=index)
    expected = policy.step(output, latents[:, last], index, compute_log_prob=False, eta=0.0).prev_sample
    torch.testing.assert_close(final, expected, rtol=1e-5, atol=1e-5)
    if kind != "sd":
        sigma = policy.process.sigmas[last]
        assert policy.process.sigmas[-1] == 0
        torch.testing.assert_close(final, latents[:, last] - sigma * output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rollouts[False]["images"], policy.decode(final), rtol=1e-5, atol=1e-5)


def _dpo_args(tmp_path, **overrides):
    from trl_dance import DiffusionDPOConfig

    values = {"output_dir": str(tmp_path / "dpo"), "use_cpu": True, "bf16": False, "report_to": "none"}
    values |= {"save_strategy": "no", "disable_tqdm": True, "resolution": 32, "max_sequence_length": 16}
    values |= {"per_device_train_batch_size": 4, "max_steps": 1}
    return DiffusionDPOConfig(**(values | overrides))


@pytest.mark.parametrize(
    ("kind", "scheme", "expected"), [("sd3", "none", 0.676), ("sd3", "logit_normal", 0.714), ("wan", "none", 0.676)]
)
def test_flow_dpo_draws_sigma_on_the_shifted_training_grid(tiny_model_dir, tmp_path, kind, scheme, expected):
    """SD3 trains at σ = shift(u), shift 3, as diffusers' SD3 scripts do: E[3u / (1 + 2u)] = 0.676 for u ~ U(0, 1)
    (unshifted: 0.5), 0.714 for u = sigmoid(N(0, 1)) (unshifted: 0.5). Wan 2.1 480p: UniPC's flow_shift 3 gives the
    same (its scheduler's `sigmas` attribute holds VP σ up to 157, which the trainer once drew from)."""
    from trl_dance import DiffusionDPOTrainer
    from trl_dance.testing import TINY_VIDEO_FRAMES, tiny_preference_dataset

    video = {"num_frames": TINY_VIDEO_FRAMES} if kind == "wan" else {}
    trainer = DiffusionDPOTrainer(
        tiny_model_dir(kind),
        args=_dpo_args(tmp_path, weighting_scheme=scheme, **video),
        train_dataset=tiny_preference_dataset(kind, 4),
    )
    latents = torch.zeros(2 * 20000, 4, 2, 2)
    pairs = trainer.pairs
    _, _, time = pairs.noised(latents, *pairs.draw(latents[::2].shape, trainer._noise_generator, "cpu"))
    sigma = time[0::2]
    assert torch.equal(time[0::2], time[1::2])  # one σ per pair
    assert abs(sigma.mean().item() - expected) < 0.01 and sigma.max() <= 1


@pytest.mark.parametrize("trainer_kind", ["dpo", "grpo"])
def test_full_finetune_reference_in_bf16_gives_zero_margin_and_kl(tiny_model_dir, tmp_path, trainer_kind):
    """Full fine-tuning of a bf16 pipeline: the frozen reference copy is the fp32 policy's copy and runs under the
    same autocast, so at step 0 the DPO margin and the GRPO KL are exactly 0."""
    from trl_dance import DiffusionDPOTrainer
    from trl_dance.testing import tiny_preference_dataset

    precision = {"bf16": True, "model_init_kwargs": {"torch_dtype": "bfloat16"}}
    if trainer_kind == "dpo":
        data = tiny_preference_dataset("sd3", 4)
        trainer = DiffusionDPOTrainer(tiny_model_dir("sd3"), args=_dpo_args(tmp_path, **precision), train_dataset=data)
        batch = trainer._prepare_inputs(trainer.data_collator([data[i] for i in range(4)]))
    else:
        args = tiny_grpo_config(tmp_path, beta=0.1, guidance_scale=1.0, **precision)
        dataset = Dataset.from_dict({"prompt": PROMPTS})
        trainer = DanceGRPOTrainer(tiny_model_dir("sd3"), "brightness", args=args, train_dataset=dataset)
        trainer._generate_and_score(_rows(PROMPTS[:2]))
        batch = trainer._microbatch(trainer._microbatches[0])
    assert trainer.ref_model is not None and all(p.dtype == torch.float32 for p in trainer.model.parameters())
    with torch.no_grad(), trainer.compute_loss_context_manager():
        trainer.compute_loss(trainer.model, batch)
    key = "margin" if trainer_kind == "dpo" else "kl"
    assert [value.item() for value in trainer._metrics[key]] == [0.0]


def test_every_save_pushes_what_load_lora_weights_reads_with_a_licensed_card(tiny_model_dir, tmp_path, monkeypatch):
    """hub_strategy="every_save": each checkpoint's push carries the diffusers LoRA and a card written at that save,
    with the base model's licence (read from its own card) and the sample gallery once samples exist. Only the Hub
    calls are stubbed."""
    import shutil
    import types

    import transformers.trainer
    import yaml

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir("flux"), base)
    (base / "README.md").write_text(
        "---\nlicense: other\nlicense_name: flux-1-dev-non-commercial-license\nlicense_link: LICENSE.md\n---\n# base\n"
    )
    uploads = []

    class FakeHubApi:
        def create_repo(self, repo_id, **kwargs):
            return types.SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, repo_id, folder_path, commit_message="", **kwargs):
            files = sorted(os.listdir(folder_path))
            card = (Path(folder_path) / "README.md").read_text() if "README.md" in files else ""
            uploads.append({"message": commit_message, "files": files, "card": card})
            return types.SimpleNamespace(done=lambda: True)

    monkeypatch.setattr(transformers.trainer, "hf_api", FakeHubApi)
    args = tiny_grpo_config(
        tmp_path / "out", max_steps=2, save_strategy="steps", save_steps=1, push_to_hub=True, hub_model_id="me/x"
    )
    lora = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"])
    trainer = DanceGRPOTrainer(
        str(base), "brightness", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora
    )
    trainer.train()
    mid_run = [upload for upload in uploads if upload["message"].startswith("Training in progress")]
    assert mid_run and all({"pytorch_lora_weights.safetensors", "README.md"} <= set(u["files"]) for u in mid_run)
    header = yaml.safe_load(mid_run[-1]["card"].split("---")[1])
    assert header["license"] == "other" and header["license_name"] == "flux-1-dev-non-commercial-license"
    assert os.path.isfile(tmp_path / "out" / "checkpoint-1" / "README.md")  # every save writes its card

    trainer.save_samples(PROMPTS[:2], torch.rand(2, 3, 32, 32))
    header = yaml.safe_load((tmp_path / "out" / "README.md").read_text().split("---")[1])
    assert header["widget"] == [{"text": p, "output": {"url": f"image_{i}.png"}} for i, p in enumerate(PROMPTS[:2])]
    assert os.path.isfile(tmp_path / "out" / "image_1.png")


def test_full_denoiser_state_dict_is_saved_in_shards_that_from_pretrained_reads(tiny_model_dir, tmp_path, monkeypatch):
    """The ZeRO-3 path (a gathered state dict) writes diffusers' sharded layout instead of one file (FLUX in fp32:
    48 GB); here with a 20 kB shard limit."""
    from diffusers import SD3Transformer2DModel

    from trl_dance.trainer import diffusion_trainer

    monkeypatch.setattr(diffusion_trainer, "MAX_SHARD_SIZE", 20_000)
    args = tiny_grpo_config(tmp_path, guidance_scale=1.0)
    trainer = DanceGRPOTrainer(
        tiny_model_dir("sd3"), "brightness", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS})
    )
    state = {key: value + 1 for key, value in trainer.model.state_dict().items()}
    trainer._save(str(tmp_path / "full"), state_dict=state)
    shards = [name for name in os.listdir(tmp_path / "full") if name.startswith("diffusion_pytorch_model-")]
    assert len(shards) > 1 and os.path.isfile(tmp_path / "full" / "diffusion_pytorch_model.safetensors.index.json")
    loaded = SD3Transformer2DModel.from_pretrained(str(tmp_path / "full")).state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def test_bf16_distillation_trains_its_fp32_student_fake_score_and_gan_head(tiny_model_dir, tmp_path):
    """DMD in the configuration its recipes run: a bf16 pipeline, AC-DMD with the GAN head, activation checkpointing and
    a teacher from another checkpoint (loaded in bf16 too). One round at lr 1e-5 moves every entry of the student's LoRA
    and of the fake score (a float32 copy, two updates), where bf16 tensors would round most of these updates away; the
    GAN head is float32 on top of autocast; the bases stay bf16."""
    from PIL import Image

    from trl_dance import DMDConfig, DMDTrainer
    from trl_dance.testing import save_tiny_pipeline

    teacher = save_tiny_pipeline("flux", str(tmp_path / "teacher"), seed=1)
    args = DMDConfig(
        **tiny_online_values(tmp_path / "run")
        | {
            "bf16": True,
            "model_init_kwargs": {"dtype": "bfloat16"},
            "loss_type": "ac_dmd",
            "gan_generator_weight": 0.5,
            "activation_checkpointing": True,
            "teacher_model_name_or_path": teacher,
            "teacher_guidance_scale": 3.5,
            "guidance_scale": 3.5,
            "num_inference_steps": 2,
            "learning_rate": 1e-5,
            "fake_score_learning_rate": 1e-5,
            "fake_score_updates": 2,
            "max_steps": 1,
        }
    )
    dataset = Dataset.from_dict({"prompt": PROMPTS[:8], "image": [Image.new("RGB", (48, 40), (250, 250, 250))] * 8})
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    trainer = DMDTrainer(tiny_model_dir("flux"), "brightness", args=args, train_dataset=dataset, peft_config=lora)
    student = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    fake = trainer.fake_score.params
    assert all(p.dtype == torch.float32 for p in [*student.values(), *fake.values()])
    bases = [trainer.ref_model, trainer.model]
    assert all(p.dtype == torch.bfloat16 for m in bases for name, p in m.named_parameters() if "lora_" not in name)
    before = {name: p.detach().clone() for name, p in [*student.items(), *(("fake." + n, p) for n, p in fake.items())]}
    trainer.train()
    head = list(trainer.gan_head.parameters())
    assert trainer.state.global_step == 1 and head and all(p.dtype == torch.float32 for p in head)
    for what, tensors in (("student", student), ("fake score", {"fake." + n: p for n, p in fake.items()})):
        moved = torch.cat([(p.detach() != before[name]).flatten() for name, p in tensors.items()])
        print(f"{what}: {moved.float().mean().item():.4f} of {moved.numel()} entries moved")
        assert moved.float().mean() > 0.999, what
