"""Preference pairs from AI feedback: samples ranked by a known reward, best over worst, reproducible, usable by
Diffusion-DPO."""

import numpy as np
import pytest

from trl_dance.ai_feedback import build_preference_pairs
from trl_dance.policies import SamplerSettings

PROMPTS = ["a cat", "a dog", "a red house", "blue sky"]
SETTINGS = SamplerSettings(num_inference_steps=6, height=32, width=32, guidance_scale=1.0, eta=0.0)


def _brightness(image):
    return np.asarray(image, dtype=np.float64).mean() / 255


def test_pairs_are_the_best_and_worst_of_each_prompt(tiny_model_dir):
    pairs = build_preference_pairs(tiny_model_dir("sd3"), PROMPTS, "brightness", SETTINGS, num_images=4, batch_size=3)
    assert pairs.column_names == ["prompt", "chosen", "rejected", "score_chosen", "score_rejected"]
    assert pairs["prompt"] == PROMPTS
    for row in pairs:
        assert row["score_chosen"] > row["score_rejected"]
        # The scores are the images' brightness (up to the 8-bit rounding of the stored PIL images).
        assert _brightness(row["chosen"]) == pytest.approx(row["score_chosen"], abs=3e-3)
        assert _brightness(row["rejected"]) == pytest.approx(row["score_rejected"], abs=3e-3)
    # Reproducible, whatever the batch size; the margin filter drops close pairs.
    again = build_preference_pairs(tiny_model_dir("sd3"), PROMPTS, "brightness", SETTINGS, num_images=4, batch_size=8)
    assert again["score_chosen"] == pytest.approx(pairs["score_chosen"], abs=1e-6)
    margins = [c - r for c, r in zip(pairs["score_chosen"], pairs["score_rejected"])]
    threshold = sorted(margins)[1]
    kept = build_preference_pairs(
        tiny_model_dir("sd3"), PROMPTS, "brightness", SETTINGS, num_images=4, min_margin=threshold
    )
    assert len(kept) == sum(m >= threshold for m in margins) == 3


def test_pairs_train_diffusion_dpo(tiny_model_dir, tmp_path):
    from conftest import tiny_dpo_config

    from trl_dance import DiffusionDPOTrainer

    pairs = build_preference_pairs(tiny_model_dir("sd3"), PROMPTS, "brightness", SETTINGS, num_images=2)
    trainer = DiffusionDPOTrainer(
        tiny_model_dir("sd3"), args=tiny_dpo_config(tmp_path, max_steps=1), train_dataset=pairs
    )
    trainer.train()
    assert trainer.state.global_step == 1


def test_bad_inputs(tiny_model_dir):
    with pytest.raises(ValueError, match="num_images must be >= 2"):
        build_preference_pairs(tiny_model_dir("sd3"), PROMPTS, "brightness", SETTINGS, num_images=1)
    with pytest.raises(ValueError, match="2 reward functions"):
        build_preference_pairs(tiny_model_dir("sd3"), PROMPTS, ["brightness", "brightness"], SETTINGS, [1.0])
    with pytest.raises(ValueError, match="text-to-image models"):
        build_preference_pairs(
            tiny_model_dir("wan"), PROMPTS, "brightness", SamplerSettings(height=32, width=32, num_frames=5)
        )
