"""OCR rewards on real engines (PP-OCRv4 through rapidocr, EasyOCR), offline, on words rendered with matplotlib's
fonts; their formulas against closed cases."""

import random

import numpy as np
import pytest
import torch

from trl_dance.rewards import EasyOCRJudge, OCRReward, get_reward_function
from trl_dance.rewards.ocr import char_iou, edit_score, exact_match, levenshtein, read_text, target_text
from trl_dance.text_task import render_word
from trl_dance.text_task.evaluation import judge_images, within_prompt_diversity

PROMPT = 'a sign that says "CAT"'


def rendered(*words, rng=None):
    return torch.stack([torch.from_numpy(np.asarray(render_word(w, rng))).permute(2, 0, 1) for w in words]) / 255


def test_formulas_closed_cases():
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert edit_score("CAT", "cat") == 1.0  # lower-cased
    assert edit_score("the cat sat", "cat") == 1.0  # a substring scores 1 (Flow-GRPO)
    assert edit_score("cot", "cat") == pytest.approx(2 / 3)
    assert edit_score("", "cat") == 0.0 and edit_score("xxxxxxxx", "cat") == 0.0  # distance capped at len(target)
    assert exact_match("c a t", "CAT") == 1.0 and exact_match("cats", "cat") == 0.0
    assert char_iou("tac", "cat") == 1.0 and char_iou("cats", "cat") == pytest.approx(3 / 4)
    assert char_iou("aa", "a") == pytest.approx(1 / 2) and char_iou("", "cat") == 0.0
    assert target_text('a sign that says "owl" and "cat"') == "owl" and target_text("no quotes") is None
    with pytest.raises(ValueError, match="empty"):
        edit_score("x", "")


@pytest.mark.parametrize("name", ["ocr", "ocr_easyocr"])
def test_ocr_rewards_rank_right_half_right_wrong_and_noise(name):
    reward = get_reward_function(name)
    images = torch.cat(
        [rendered("CAT", "COT", "DOG"), torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))]
    )
    right, half, wrong, noise = reward([PROMPT] * 4, images)
    assert right == 1.0 and half == pytest.approx(2 / 3) and wrong == 0.0 and noise == 0.0


def test_ocr_reward_targets_metrics_and_abstention():
    reward, logged = OCRReward(metric="exact"), {}
    images = rendered("owl", "owl", "owl")
    scores = reward(['a sign that says "owl"', "a photo of an owl", 'a sign that says "cow"'], images,
                    log_metric=lambda name, value: logged.setdefault(name, value))  # fmt: skip
    assert scores == [1.0, None, 0.0]  # no quoted text: abstains, as TRL's rewards do
    assert logged == {"ocr_exact/edit": pytest.approx(2 / 3), "ocr_exact/exact": 0.5, "ocr_exact/char_iou": 0.75}
    by_column = OCRReward(target_column="text")(["x", "y"], rendered("owl", "sun"), text=["owl", "owl"])
    assert by_column == [1.0, 0.0]
    with pytest.raises(ValueError, match="no prompt holds a quoted target"):
        reward(["a photo"], images[:1])
    with pytest.raises(ValueError, match="no dataset column 'text'"):
        OCRReward(target_column="text")(["x"], images[:1])
    with pytest.raises(ValueError, match="unknown OCR engine"):
        OCRReward(engine="tesseract")


def test_engines_read_every_font_and_grade_blur():
    """Both engines read the training data's styles; blur lowers the reward by degrees (a graded signal)."""
    words = ["cat", "dog", "owl", "sky", "pen", "mug"]
    images = rendered(*words, rng=random.Random(0))
    scores = judge_images(images, words)
    assert scores["rapidocr/edit"] >= 0.8 and scores["easyocr/exact"] >= 0.8, scores
    kernel = torch.ones(1, 1, 5, 5) / 25  # a 5 px box blur, then one more: legibility falls
    blurred = torch.nn.functional.conv2d(images.flatten(0, 1)[:, None], kernel, padding=2)
    twice = torch.nn.functional.conv2d(blurred, kernel, padding=2)
    sharp, soft, softer = (sum(map(edit_score, read_text(x.view_as(images)), words)) for x in (images, blurred, twice))
    assert sharp >= soft >= softer and sharp > softer, (sharp, soft, softer)


def test_easyocr_judge_is_registered_and_named():
    judge = EasyOCRJudge(metric="char_iou")
    assert judge.__name__ == "ocr_easyocr_char_iou" and OCRReward().__name__ == "ocr"


def test_within_prompt_diversity_closed_form():
    same = torch.full((2, 3, 3, 4, 4), 0.5)
    assert within_prompt_diversity(same) == 0.0
    pair = torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)])[None]  # RMS difference 1 between the two
    assert within_prompt_diversity(pair) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="G >= 2"):
        within_prompt_diversity(same[:, :1])
