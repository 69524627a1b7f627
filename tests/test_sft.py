"""Supervised fine-tuning (DiffusionSFTTrainer): samples move toward the training images (FLUX, SD3, Wan); evaluation
is deterministic; bad data is named."""

import numpy as np
import pytest
import torch
from conftest import LEARNING_SEED, TINY_VIDEO_FRAMES
from datasets import Dataset
from peft import LoraConfig
from PIL import Image

from trl_dance import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_dance.sampling import RolloutPlan, generate, sample_generators
from trl_dance.testing import TINY_PIPELINES
from trl_dance.trainer.evaluation import policy_with

PROMPTS = ["a cat", "a dog", "a red house", "blue sky"]
RED = Image.fromarray(np.array([[[220, 30, 30]]], dtype=np.uint8).repeat(32, 0).repeat(32, 1))


def _sharp_posterior_pipeline(kind: str, folder) -> str:
    """The tiny pipeline with its VAE's posterior as sharp as a real VAE's (log-variance -12): the random tiny VAE's
    posterior std is about 1.6 per latent dimension, so its "training image" would be mostly noise."""
    pipeline = TINY_PIPELINES[kind](0)
    vae = pipeline.vae
    moments = vae.quant_conv if getattr(vae, "quant_conv", None) is not None else vae.encoder.conv_out
    half = moments.out_channels // 2
    with torch.no_grad():
        moments.weight[half:] = 0
        moments.bias[half:] = -12.0
    pipeline.save_pretrained(str(folder))
    return str(folder)


def _rows(video: bool, count: int = 8) -> dict:
    rows = {"prompt": (PROMPTS * count)[:count]}
    rows["video" if video else "image"] = [[RED] * TINY_VIDEO_FRAMES if video else RED for _ in range(count)]
    return rows


def _config(tmp_path, video: bool, **overrides) -> DiffusionSFTConfig:
    values = {
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "bf16": False, "report_to": "none",
        "save_strategy": "no", "disable_tqdm": True, "resolution": 32, "max_sequence_length": 16,
        "per_device_train_batch_size": 4, "lr_scheduler_type": "constant", "logging_steps": 10, "seed": LEARNING_SEED,
        "num_frames": TINY_VIDEO_FRAMES if video else None,
    }  # fmt: skip
    return DiffusionSFTConfig(**(values | overrides))


def _distance_to_training_latent(trainer) -> float:
    """Mean squared distance of deterministic 4-step samples (fixed noise, the 4 prompts) to the training image's
    latent."""
    policy = policy_with(trainer.policy, num_inference_steps=4)
    row = {"video": [RED] * TINY_VIDEO_FRAMES} if policy.is_video else {"image": RED}
    batch = trainer._collator(trainer.args, 0, training=False)([{"prompt": p, **row} for p in PROMPTS])
    with torch.no_grad():
        target = policy.encode_images(batch["pixel_values"], None)
        samples = generate(
            policy, trainer.model, sample_generators(123, -1, 0, 4), policy.encode_prompts(PROMPTS),
            RolloutPlan.deterministic(policy.num_steps),
        )["final_latents"]  # fmt: skip
    return (samples - target).square().mean().item()


# A LoRA on the attention projections, 60 steps of 4 images. Measured after / before over seeds 0, 1, 7, 42 and 1 or 2
# threads: FLUX 0.54–0.59, SD3 0.71–0.75, Wan 0.56–0.63 (the bound: 0.85). The tiny SD1.5 UNet (ε target: the noise, whatever the
# image) is not here: its LoRA left the ε loss at 1.0 and the samples within 5 % of where they were in 60-120 steps for
# seeds 1, 2, 42 (0.15 of the distance for seed 0), so no margin holds; its target is checked in test_forward_process.
@pytest.mark.parametrize(("kind", "learning_rate"), [("flux", 3e-2), ("sd3", 3e-2), ("wan", 3e-2)])
def test_sft_moves_samples_toward_the_training_images(tmp_path, kind, learning_rate):
    video = kind == "wan"
    trainer = DiffusionSFTTrainer(
        _sharp_posterior_pipeline(kind, tmp_path / kind),
        args=_config(tmp_path, video, learning_rate=learning_rate, max_steps=60),
        train_dataset=Dataset.from_dict(_rows(video)),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
    )
    before = _distance_to_training_latent(trainer)
    trainer.train()
    after = _distance_to_training_latent(trainer)
    print(f"learning: SFT {kind} distance {before:.4f} -> {after:.4f} ({after / before:.3f})")
    assert after < 0.85 * before
    mse = [entry["mse"] for entry in trainer.state.log_history if "mse" in entry]
    assert mse[-1] < mse[0]


def test_evaluation_is_deterministic_and_bad_data_is_named(tiny_model_dir, tmp_path):
    rows = Dataset.from_dict(_rows(False, 4))
    trainer = DiffusionSFTTrainer(
        tiny_model_dir("flux"), args=_config(tmp_path, False, max_steps=1), train_dataset=rows, eval_dataset=rows
    )
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first["eval_loss"] == second["eval_loss"] > 0
    with pytest.raises(ValueError, match=r"no column \['image'\].*dataset_image_field"):
        DiffusionSFTTrainer(
            tiny_model_dir("flux"),
            args=_config(tmp_path, False),
            train_dataset=Dataset.from_dict({"prompt": ["a"], "picture": [RED]}),
        )
    with pytest.raises(ValueError, match="conditions on \\['image'\\]"):
        DiffusionSFTTrainer(tiny_model_dir("flux-kontext"), args=_config(tmp_path, False), train_dataset=rows)
    trainer = DiffusionSFTTrainer(
        tiny_model_dir("flux"),
        args=_config(tmp_path, False, dataset_image_field="picture", max_steps=1),
        train_dataset=Dataset.from_dict({"prompt": ["a", "b", "c", "d"], "picture": [RED, None, RED, RED]}),
    )
    trainer.train()  # the missing image is skipped and counted
    assert trainer._missing_images == 1
