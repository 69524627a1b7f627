"""Rollout images, captions and reward histograms reach the Trainer's trackers, in the same run as the scalar
metrics. Each tracker writes locally (TensorBoard event files, a W&B offline run, trackio's SQLite project), and
the test reads what was written."""

import glob
import json
import os
import pathlib
import sqlite3
import time

import pytest
from conftest import PROMPTS, tiny_grpo_config
from datasets import Dataset
from peft import LoraConfig
from PIL import Image

from trl_dance import DanceGRPOTrainer


def _train(tiny_model_dir, tmp_path, report_to, **overrides):
    args = tiny_grpo_config(
        tmp_path / "out",
        report_to=report_to,
        gradient_accumulation_steps=5,  # 8 samples x 5 steps / 8 = 5 micro-steps: one update per round
        max_steps=4,
        log_completions_steps=2,  # rollouts start at steps 0, 1, 2, 3: media at 0 and 2
        num_completions_to_log=3,
        learning_rate=1e-3,
        **overrides,
    )
    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"),
        "brightness",
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]),
    )
    trainer.train()
    return trainer


def test_rollout_media_in_tensorboard(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logs))  # transformers 5 reads it instead of logging_dir
    _train(tiny_model_dir, tmp_path, "tensorboard")

    events = EventAccumulator(
        glob.glob(str(logs / "**" / "events.*"), recursive=True)[0],
        size_guidance={"images": 0, "histograms": 0, "tensors": 0},
    )
    events.Reload()
    assert [image.step for image in events.Images("completions/images")] == [0, 2]
    assert [h.step for h in events.Histograms("completions/reward")] == [0, 2]
    assert all(h.histogram_value.num == 8 for h in events.Histograms("completions/reward"))  # the whole round
    captions = events.Tensors("completions/captions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert captions.count("reward 0.") == 3 and any(p in captions for p in PROMPTS)
    assert "train/reward" in events.Tags()["scalars"]  # beside the scalar metrics of the same run


def test_rollout_media_in_wandb_offline_run(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb = pytest.importorskip("wandb")
    _train(tiny_model_dir, tmp_path, "wandb")
    wandb.finish()  # the Trainer leaves the run open for the user's own logging; finishing writes it out

    (run,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    images = sorted(glob.glob(f"{run}/files/media/images/completions/images_*.png"))
    assert len(images) == 2 * 3  # two media steps, three images each
    assert all(Image.open(path).size == (32, 32) for path in images)
    # The run's record file holds the history rows: captions, the histogram and the Trainer's step metric.
    (records,) = glob.glob(f"{run}/run-*.wandb")
    # W&B's service process writes the record file; on a loaded machine its last rows can land after finish().
    deadline = time.monotonic() + 60
    while b"bins" not in (data := pathlib.Path(records).read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert data.count(b"completions/reward") >= 2 and b"bins" in data  # the histogram
    assert sum(data.count(f"{p} | reward 0.".encode()) for p in PROMPTS) >= 6
    assert b"train/reward" in data and b"train/global_step" in data


def test_rollout_media_in_trackio_project(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("trackio")
    _train(tiny_model_dir, tmp_path, "trackio", project=tmp_path.name)  # in TRACKIO_DIR, set by conftest

    directory = os.environ["TRACKIO_DIR"]
    (database,) = glob.glob(f"{directory}/{tmp_path.name}.db")
    rows = sqlite3.connect(database).execute("select step, metrics from metrics order by id").fetchall()
    media = [(step, json.loads(metrics)) for step, metrics in rows if b"completions/" in metrics]
    assert [step for step, _ in media] == [0, 2]
    for _, logged in media:
        assert sorted(logged) == ["completions/image_0", "completions/image_1", "completions/image_2"]
        for entry in logged.values():
            assert entry["caption"].split(" | reward ")[0] in PROMPTS
            assert Image.open(f"{directory}/media/{entry['file_path']}").size == (32, 32)
    assert any(b"train/reward" in metrics for _, metrics in rows)


def test_a_named_tracker_without_its_package_is_refused_naming_the_extra(tmp_path, monkeypatch):
    """transformers would raise from its callback after the model load; the config names the extra instead."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"report_to wandb needs wandb: pip install 'trl-dance\[tracking\]'"):
        tiny_grpo_config(tmp_path, report_to=["tensorboard", "wandb"])
    tiny_grpo_config(tmp_path, report_to=["tensorboard"])  # installed: accepted
