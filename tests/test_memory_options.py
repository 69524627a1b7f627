"""Frozen components in half precision and text encoders offloaded between encodes."""

import pytest
import torch
from conftest import PROMPTS, tiny_grpo_config
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer, DiffusionDPOConfig, DiffusionDPOTrainer
from trl_dance.testing import tiny_preference_dataset


def _lora():
    return LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])


@pytest.mark.parametrize("kind", ["flux", "sd"])
def test_grpo_with_bf16_frozen_components_and_offloaded_text_encoders(tiny_model_dir, tmp_path, kind):
    args = tiny_grpo_config(
        tmp_path, frozen_dtype="bfloat16", offload_text_encoders=True, max_steps=1, gradient_accumulation_steps=5
    )
    trainer = DanceGRPOTrainer(
        tiny_model_dir(kind), "brightness", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=_lora(),
    )  # fmt: skip
    policy = trainer.policy
    assert policy.pipeline.vae.dtype == torch.bfloat16
    assert all(encoder.dtype == torch.bfloat16 for encoder in policy.text_encoders())
    assert policy.denoiser.dtype == torch.float32  # the trained weights keep their precision

    moves = []
    for encoder in policy.text_encoders():
        original = encoder.to

        def recording_to(*args, _original=original, **kwargs):
            moves.append(str(args[0]))
            return _original(*args, **kwargs)

        encoder.to = recording_to
    trainer.train()
    # Each encoder went to the accelerator for the round's one encode (and, with CFG, the cached empty prompt's)
    # and back to the CPU.
    count, encodes = len(policy.text_encoders()), 2 if policy.use_cfg else 1
    assert moves == ([str(trainer.accelerator.device)] * count + ["cpu"] * count) * encodes
    history = trainer.state.log_history[0]
    assert abs(history["ratio/mean"] - 1) < 1e-4 and torch.isfinite(torch.tensor(history["loss"]))


def test_dpo_with_bf16_frozen_components(tiny_model_dir, tmp_path):
    args = DiffusionDPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
        resolution=32, max_sequence_length=16, per_device_train_batch_size=2, max_steps=2, beta=500,
        frozen_dtype="bfloat16", logging_steps=1,
    )  # fmt: skip
    trainer = DiffusionDPOTrainer(
        tiny_model_dir("sd"), args=args, train_dataset=tiny_preference_dataset("sd", 8), peft_config=_lora()
    )
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["loss"] == pytest.approx(0.6931, abs=1e-3)  # ln 2 at initialisation: bf16 VAE latents are fine


def test_frozen_dtype_is_checked(tmp_path):
    with pytest.raises(ValueError, match="frozen_dtype"):
        tiny_grpo_config(tmp_path, frozen_dtype="int8")
