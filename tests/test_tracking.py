"""Rollout images, captions and reward histograms reach the Trainer's trackers."""

import glob

import pytest
from conftest import PROMPTS, tiny_grpo_config
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer

pytest.importorskip("tensorboard")


def test_rollout_media_in_tensorboard(tiny_model_dir, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logs))  # transformers 5 reads it instead of logging_dir
    args = tiny_grpo_config(
        tmp_path,
        report_to="tensorboard",
        gradient_accumulation_steps=5,  # 8 samples x 5 steps / 8 = 5 micro-steps: one update per round
        max_steps=4,
        log_completions_steps=2,
        num_completions_to_log=3,
        learning_rate=1e-3,
    )
    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"),
        "brightness",
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]),
    )
    trainer.train()

    events = EventAccumulator(
        glob.glob(str(logs / "**" / "events.*"), recursive=True)[0],
        size_guidance={"images": 0, "histograms": 0, "tensors": 0},
    )
    events.Reload()
    # Rollouts start at steps 0, 1, 2, 3; media every 2 steps.
    assert [image.step for image in events.Images("completions/images")] == [0, 2]
    assert [h.step for h in events.Histograms("completions/reward")] == [0, 2]
    assert all(h.histogram_value.num == 8 for h in events.Histograms("completions/reward"))  # the whole round
    captions = events.Tensors("completions/captions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert captions.count("reward 0.") == 3 and any(p in captions for p in PROMPTS)
    assert "train/reward" in events.Tags()["scalars"]  # beside the scalar metrics of the same run
