"""HunyuanVideo in the trainers: text-to-video, one-frame text-to-image (DanceGRPO's HunyuanVideo-T2I) and SkyReels-V1
image-to-video; ratio 1, the saved LoRA in the pipeline, learning (the policy against the pipeline: test_policies.py)."""

import pytest
import torch
from conftest import (
    LEARNING_SEED,
    LORA_TARGETS,
    PROMPTS,
    assert_learned,
    assert_saved_lora_reproduces_training,
    max_ratio_deviation,
    tiny_grpo_config,
    tiny_online_values,
)
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer
from trl_dance.testing import TINY_VIDEO_FRAMES, tiny_condition_images

FRAMES = {"video": TINY_VIDEO_FRAMES, "image": 1}


def _trainer(tiny_model_dir, tmp_path, frames, reward="brightness", **overrides):
    values = {"guidance_scale": 6.0, "num_frames": frames} | overrides
    return DanceGRPOTrainer(
        tiny_model_dir("hunyuan-video"),
        reward,
        args=tiny_grpo_config(tmp_path, **values),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian"),
    )


@pytest.mark.parametrize("mode", ["video", "image"])
def test_hunyuan_ratio_is_one_and_samples_have_the_frames_asked(tiny_model_dir, tmp_path, mode):
    trainer = _trainer(tiny_model_dir, tmp_path, FRAMES[mode])
    trainer._generate_and_score([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    assert max_ratio_deviation(trainer) < 1e-5
    assert trainer._rollout["images"].shape == (8, FRAMES[mode], 3, 32, 32)
    trainer.create_model_card()
    task = "text-to-video" if mode == "video" else "text-to-image"
    assert f"pipeline_tag: {task}" in (tmp_path / "README.md").read_text()


def test_hunyuan_lora_reloads_into_the_pipeline(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path / "run", FRAMES["video"], max_steps=2)
    trainer.train()
    trainer.save_model(str(tmp_path / "lora"))
    assert_saved_lora_reproduces_training(
        trainer, tiny_model_dir("hunyuan-video"), str(tmp_path / "lora"), PROMPTS[:2]
    )


def test_hunyuan_frame_count_must_fit_the_vae(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="num_frames must be 1 \\+ a multiple of 4"):
        _trainer(tiny_model_dir, tmp_path, 4)


# Gains (first 3 -> last 3 rounds, lr 3e-2, embedded guidance 6) over seeds 42, 1, 2, 3, 4: one-frame images
# 0.029-0.081 in 30 rounds, 5-frame videos 0.029-0.068 in 40 rounds (sample std 0.002-0.003).
@pytest.mark.slow
@pytest.mark.parametrize(("mode", "rounds", "margin"), [("video", 40, 0.012), ("image", 30, 0.012)])
def test_hunyuan_brightness_rises(tiny_model_dir, tmp_path, mode, rounds, margin):
    """Learning: GRPO on the tiny HunyuanVideo raises the brightness of its videos and of its one-frame images."""
    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        FRAMES[mode],
        generation_batch_size=32,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=10,
        max_steps=rounds,
        learning_rate=3e-2,
        seed=LEARNING_SEED,
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"hunyuan {mode}: per round {rewards}")
    assert_learned("brightness", first, last, trainer.state.log_history[0]["reward_std"], margin)


def _i2v_dataset():
    return Dataset.from_dict({"prompt": PROMPTS, "image": tiny_condition_images(len(PROMPTS))})


IMAGE_TO_VIDEO = ("skyreels-i2v", "hunyuan-video15-i2v")


def _skyreels(tiny_model_dir, tmp_path, kind="skyreels-i2v", **overrides):
    values = {"guidance_scale": 6.0, "num_frames": TINY_VIDEO_FRAMES} | overrides
    if kind == "hunyuan-video15-i2v":
        values["max_sequence_length"] = 64  # its text lengths are fixed by the pipeline's template crop
    return DanceGRPOTrainer(
        tiny_model_dir(kind),
        "brightness",
        args=tiny_grpo_config(tmp_path, **values),
        train_dataset=_i2v_dataset(),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian"),
    )


@pytest.mark.parametrize("kind", IMAGE_TO_VIDEO)
def test_image_to_video_ratio_is_one_with_cfg_and_the_image_conditions_every_sample(tiny_model_dir, tmp_path, kind):
    """SkyReels-V1 I2V, HunyuanVideo 1.5 I2V: CFG through both branches in sampling and loss; on-policy ratio 1; the
    image changes the prediction; the LoRA reloads into the pipeline."""
    trainer = _skyreels(tiny_model_dir, tmp_path / "run", kind, max_steps=1)
    dataset = _i2v_dataset()
    trainer._generate_and_score([dict(dataset[i]) for i in (0, 1) for _ in range(4)])
    assert trainer.policy.use_cfg and max_ratio_deviation(trainer) < 1e-5
    latents = trainer.policy.initial_noise([torch.Generator().manual_seed(0)] * 2)
    with torch.no_grad():
        cond = trainer.policy.encode_prompts(["a cat"] * 2, image=[dataset[0]["image"], dataset[1]["image"]])
        output = trainer.policy.predict(trainer.model, latents, cond, at=torch.tensor([1, 1]))
    assert (output[0] - output[1]).abs().max() > 1e-3
    trainer.train()
    trainer.save_model(str(tmp_path / "lora"))
    trainer.create_model_card()
    assert "pipeline_tag: image-to-video" in (tmp_path / "lora" / "README.md").read_text()
    images = [dataset[0]["image"], dataset[1]["image"]]
    assert_saved_lora_reproduces_training(
        trainer, tiny_model_dir(kind), str(tmp_path / "lora"), ["a cat"] * 2, image=images
    )


# One optimizer update per round, as the DanceGRPO paper recommends for SkyReels-I2V; CFG 6 in sampling and loss. Gains
# over seeds 42, 1, 2: SkyReels 0.053-0.068 in 30 rounds (sample std 0.002-0.003); HunyuanVideo 1.5 I2V 0.114-0.115 in 10
# rounds (sample std 0.005).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "rounds", "margin"), [("skyreels-i2v", 30, 0.012), ("hunyuan-video15-i2v", 10, 0.03)]
)
def test_image_to_video_brightness_rises(tiny_model_dir, tmp_path, kind, rounds, margin):
    trainer = _skyreels(
        tiny_model_dir,
        tmp_path,
        kind,
        generation_batch_size=32,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=10,  # 32 videos x 5 steps / 16: the round's 10 micro-batches, one update
        max_steps=rounds,
        learning_rate=3e-2,
        seed=LEARNING_SEED,
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"{kind}: per round {rewards}")
    assert_learned("brightness", first, last, trainer.state.log_history[0]["reward_std"], margin)


def test_hunyuan_video15_encodes_a_batch_of_videos_as_each_alone():
    """HunyuanVideo 1.5's VAE breaks on batches of several videos in diffusers 0.42.1 (its mid-block attention): its
    layout encodes (Diffusion-DPO, SFT) and decodes one video at a time, each with its own generator."""
    from trl_dance.policies import SamplerSettings, make_policy
    from trl_dance.testing import TINY_PIPELINES

    settings = SamplerSettings(num_inference_steps=4, height=32, width=32, num_frames=TINY_VIDEO_FRAMES)
    policy = make_policy(TINY_PIPELINES["hunyuan-video15"](0), settings)
    videos = torch.rand(2, TINY_VIDEO_FRAMES, 3, 32, 32) * 2 - 1
    both = policy.encode_images(videos, [torch.Generator().manual_seed(i) for i in range(2)])
    alone = [policy.encode_images(videos[i : i + 1], torch.Generator().manual_seed(i)) for i in range(2)]
    assert torch.equal(both, torch.cat(alone)) and both.shape[0] == 2
    assert policy.decode(both).shape == (2, TINY_VIDEO_FRAMES, 3, 32, 32)


def test_meanflow_checkpoint_trains_with_grpo_and_art(tmp_path):
    """A HunyuanVideo 1.5 MeanFlow (step-distilled) image-to-video checkpoint, saved and loaded like a Hub id, is no
    longer refused: GRPO samples its flow-map jumps with the on-policy ratio 1, and ART (a forward-process loss, which
    reads the instantaneous velocity u(x_t, t, t)) trains a round on it; DMD, whose student needs x̂0 from one jump to
    0, refuses it."""
    from trl_dance import DiffusionNFTConfig, DiffusionNFTTrainer, DMDConfig, DMDTrainer
    from trl_dance.testing.hunyuan_video import tiny_hunyuan_video15_i2v_pipeline

    folder = str(tmp_path / "meanflow")
    tiny_hunyuan_video15_i2v_pipeline(0, meanflow=True).save_pretrained(folder)
    dataset = _i2v_dataset()
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
    video = {"num_frames": TINY_VIDEO_FRAMES, "max_sequence_length": 64}
    grpo = DanceGRPOTrainer(
        folder, "brightness", args=tiny_grpo_config(tmp_path / "grpo", guidance_scale=6.0, **video),
        train_dataset=dataset, peft_config=lora,
    )  # fmt: skip
    assert grpo.policy.flow_map
    grpo._generate_and_score([dict(dataset[i]) for i in (0, 1) for _ in range(4)])
    assert max_ratio_deviation(grpo) < 1e-5
    values = tiny_online_values(tmp_path / "art") | video | {"guidance_scale": 1.0, "loss_type": "art"}
    values |= {"timestep_fraction": 0.5, "per_device_train_batch_size": 6, "max_steps": 2}
    art = DiffusionNFTTrainer(folder, "brightness", args=DiffusionNFTConfig(**values), train_dataset=dataset,
                              peft_config=lora)  # fmt: skip
    art.train()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in art.state.log_history if "loss" in h)
    with pytest.raises(ValueError, match="flow map"):
        DMDTrainer(folder, "brightness", args=DMDConfig(**tiny_online_values(tmp_path / "dmd") | video),
                   train_dataset=dataset, peft_config=lora)  # fmt: skip


def _meanflow_nft(tmp_path, **overrides):
    from trl_dance import DiffusionNFTConfig, DiffusionNFTTrainer
    from trl_dance.testing.hunyuan_video import tiny_hunyuan_video15_i2v_pipeline

    folder = str(tmp_path / "meanflow")
    tiny_hunyuan_video15_i2v_pipeline(0, meanflow=True).save_pretrained(folder)
    values = tiny_online_values(tmp_path / "out") | {"num_frames": TINY_VIDEO_FRAMES, "max_sequence_length": 64}
    values |= {"guidance_scale": 1.0, "timestep_fraction": 0.5, "gradient_accumulation_steps": None} | overrides
    return DiffusionNFTTrainer(folder, "brightness", args=DiffusionNFTConfig(**values), train_dataset=_i2v_dataset(),
                               peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS))  # fmt: skip


def test_meanflow_nft_pairs_and_zero_gradient_at_zero_advantage(tmp_path):
    """MeanFlowNFT on a MeanFlow checkpoint: items get end times r (r = t, r = 0 and r in (0, t) all occur); the
    correction (t − r)·dF/dt is 0 exactly where r = t and not elsewhere; it is shared by θ and the old policy, so at
    θ = θ_old with all advantages 0 every LoRA gradient is exactly 0."""
    trainer = _meanflow_nft(tmp_path, beta=0.0)
    assert trainer._flow_map
    rows = [dict(_i2v_dataset()[i]) for i in (0, 1) for _ in range(4)]
    trainer._generate_and_score(rows)
    inputs = [trainer._microbatch(item) for item in trainer._microbatches]
    ends = torch.cat([i["cond"]["flow_map_end"] for i in inputs])
    sigmas = torch.cat([i["sigma"] for i in inputs])
    assert (ends == sigmas).any() and (ends == 0).any() and ((ends > 0) & (ends < sigmas)).any()
    correction = trainer._flow_map_correction(inputs[0])
    jump = torch.zeros(len(correction), dtype=torch.bool)
    jump[inputs[0]["jump_rows"]] = True
    per_row = correction.flatten(1).abs().amax(dim=1)
    assert torch.equal(per_row[~jump], torch.zeros_like(per_row[~jump])) and (per_row[jump] > 0).all()
    trainer._rollout["advantages"] = torch.zeros_like(trainer._rollout["advantages"])
    for item in trainer._microbatches:
        trainer.compute_loss(trainer.model, trainer._microbatch(item)).backward()
    grads = [p.grad for p in trainer.model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.abs().max() < 1e-9 for g in grads)


# MeanFlowNFT on the tiny MeanFlow HunyuanVideo 1.5 I2V (16 videos a round, 3 of 6 levels, one update per round, 20
# rounds): brightness gains 0.039, 0.047, 0.025 over seeds 42, 1, 2 (first-round std 0.003-0.004); margin the
# smallest / 2.3. (12 rounds: 0.006-0.038; 4 updates per round: -0.005 to 0.050.)
@pytest.mark.slow
def test_meanflow_nft_raises_the_reward(tmp_path):
    trainer = _meanflow_nft(
        tmp_path, generation_batch_size=16, per_device_train_batch_size=12, max_steps=20, seed=LEARNING_SEED
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert_learned("brightness", first, last, trainer.state.log_history[0]["reward_std"], MEANFLOW_MARGIN)


MEANFLOW_MARGIN = 0.011
