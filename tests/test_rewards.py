import io

import pytest
import torch
from PIL import Image

from trl_dance.rewards import (
    brightness,
    get_reward_function,
    jpeg_compressibility,
    jpeg_incompressibility,
    score_images,
)


def test_registry_names_callables_and_import_paths():
    assert get_reward_function("brightness") is brightness
    assert get_reward_function("trl_dance.rewards.pixel:jpeg_compressibility") is jpeg_compressibility
    custom = lambda prompts, images, **kw: [0.0] * len(prompts)  # noqa: E731
    assert get_reward_function(custom) is custom
    with pytest.raises(ValueError, match="registered rewards"):
        get_reward_function("hps")
    with pytest.raises(ValueError, match="no callable"):
        get_reward_function("trl_dance.rewards.pixel:nothing")


def test_pixel_rewards_match_direct_computation():
    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.tensor(brightness(["a"] * 3, images)), images.mean(dim=(1, 2, 3)))
    pixels = (images[1] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    assert jpeg_incompressibility(["a"] * 3, images)[1] == pytest.approx(buffer.tell() / 1000)
    assert jpeg_compressibility(["a"] * 3, images)[1] == pytest.approx(-buffer.tell() / 1000)
    flat = torch.full((1, 3, 16, 16), 0.5)
    assert jpeg_incompressibility(["a"], flat)[0] < jpeg_incompressibility(["a"], images[:1])[0]
    with pytest.raises(ValueError, match="shape"):
        brightness(["a"], torch.rand(3, 16, 16))


def test_score_images_stacks_and_validates():
    images = torch.rand(2, 3, 8, 8)
    scores = score_images([brightness, lambda prompts, images, **kw: torch.tensor([1.0, 2.0])], ["a", "b"], images, {})
    assert scores.shape == (2, 2) and scores.dtype == torch.float32
    with pytest.raises(ValueError, match="returned 1 values for 2 images"):
        score_images([lambda prompts, images, **kw: [1.0]], ["a", "b"], images, {})


def test_dotted_reward_paths_as_in_trl():
    """``pkg.module.func`` (TRL's GRPO script form) resolves like ``pkg.module:func``; a wrong one names the module."""
    from trl_dance.rewards import get_reward_function
    from trl_dance.rewards.pixel import brightness

    assert get_reward_function("trl_dance.rewards.pixel.brightness") is brightness
    assert get_reward_function("trl_dance.rewards.pixel:brightness") is brightness
    with pytest.raises(ValueError, match="cannot import 'no_such_package.rewards'"):
        get_reward_function("no_such_package.rewards.score")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        get_reward_function("trl_dance.rewards.pixel.missing")


def test_abstaining_group_wise_rewards_and_trl_extras():
    """None/NaN abstains (the weighted sum skips it, a row no reward scores is an error); a group-wise reward is called
    once per run of equal group ids; every function receives the extra keyword arguments."""
    from trl_dance.rewards import weighted_reward_sum

    images = torch.rand(6, 3, 8, 8)
    prompts = ["a cat", "a cat", "a cat", "text: hi", "text: hi", "text: hi"]
    calls = []

    def ocr(prompts, images, **kwargs):  # applies to text prompts only
        return [1.0 if p.startswith("text") else None for p in prompts]

    def ranks(prompts, images, trainer_state, **kwargs):
        calls.append((len(prompts), trainer_state))
        return torch.argsort(torch.argsort(images.mean(dim=(1, 2, 3)))).float() / (len(prompts) - 1)

    ranks.groupwise = True
    scores = score_images(
        [brightness, ocr, ranks], prompts, images, {}, groups=[0, 0, 0, 1, 1, 1], extra={"trainer_state": "S"}
    )
    assert calls == [(3, "S"), (3, "S")]  # one call per group
    assert torch.isnan(scores[:3, 1]).all() and (scores[3:, 1] == 1).all()
    assert sorted(scores[:3, 2].tolist()) == [0.0, 0.5, 1.0]  # ranks within each group
    total = weighted_reward_sum(scores, torch.tensor([1.0, 2.0, 0.0]))
    torch.testing.assert_close(total, scores[:, 0] + torch.tensor([0.0, 0, 0, 2, 2, 2]))
    with pytest.raises(ValueError, match=r"no reward scored sample 1 \(prompt 'b'\)"):
        weighted_reward_sum(torch.tensor([[1.0], [float("nan")]]), torch.ones(1), ["a", "b"])
    with pytest.raises(ValueError, match="infinite in float32"):
        score_images([lambda prompts, images, **kw: [float("-inf")] * len(prompts)], ["a"], images[:1], {})


def test_grpo_with_an_abstaining_reward_and_logged_metrics(tiny_model_dir, tmp_path):
    """A reward that applies to half the prompts: its statistics are over the rows it scored, the total is the
    weighted sum of the rewards that scored each row, and its log_metric values reach the logs."""
    from conftest import tiny_grpo_config
    from datasets import Dataset
    from transformers import TrainerState

    from trl_dance import DanceGRPOTrainer

    seen = []

    def cats_only(prompts, images, trainer_state, log_metric, **kwargs):
        seen.append(trainer_state)
        scored = ["cat" in p for p in prompts]
        log_metric("cats_only/fraction_scored", sum(scored) / len(scored))
        return [1.0 if s else None for s in scored]

    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"),
        ["brightness", cats_only],
        args=tiny_grpo_config(tmp_path, max_steps=1, logging_steps=1, num_generations=4, generation_batch_size=8),
        train_dataset=Dataset.from_dict({"prompt": ["a cat", "a dog"]}),
    )
    trainer.train()
    (logged,) = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert logged["rewards/cats_only/mean"] == 1.0 and logged["cats_only/fraction_scored"] == 0.5
    assert seen and isinstance(seen[0], TrainerState)
    rollout = trainer._rollout
    cats = torch.tensor(["cat" in p for p in rollout["prompts"]])
    brightness_ = rollout["images"].mean(dim=(1, 2, 3))
    torch.testing.assert_close(rollout["rewards"].cpu(), brightness_ + cats.float(), atol=1e-6, rtol=0)


def test_trl_style_rewards_are_called_as_they_are():
    """A reward written for trl.GRPOTrainer (`completions`, **kwargs) and one that names only what it reads are
    called without adaptation; both see the same samples as `images`."""

    def trl_style(completions, **kwargs):
        return [float(c.mean()) for c in completions]

    def only_images(images):
        return images.mean(dim=(1, 2, 3)).tolist()

    images = torch.rand(3, 3, 8, 8)
    scores = score_images([trl_style, only_images, brightness], ["a"] * 3, images, {"extra": [1, 2, 3]})
    torch.testing.assert_close(scores[:, 0], scores[:, 2])
    torch.testing.assert_close(scores[:, 1], scores[:, 2])


def test_reward_signatures_are_checked_before_any_model_work():
    from trl_dance.rewards import check_reward_signature

    def needs_ids(prompts, completions, completion_ids, **kwargs):
        return [0.0] * len(prompts)

    def needs_column(prompts, images, style):
        return [0.0] * len(prompts)

    def sees_nothing(prompts):
        return [0.0] * len(prompts)

    with pytest.raises(ValueError, match=r"'needs_ids' requires \['completion_ids'\] \(TRL's token ids"):
        check_reward_signature(needs_ids, columns=[])
    check_reward_signature(needs_column, columns=["style"])
    with pytest.raises(ValueError, match=r"requires \['style'\].*columns \[\]"):
        check_reward_signature(needs_column, columns=[])
    with pytest.raises(ValueError, match="takes neither `images` nor TRL's `completions`"):
        check_reward_signature(sees_nothing)


def test_nan_is_an_error_none_abstains():
    """None abstains on a row; NaN (what a broken scorer returns) stops training naming the reward and the rows,
    alone or beside another reward."""
    images = torch.rand(2, 3, 8, 8)

    def broken(prompts, images, **kwargs):
        return [float("nan"), 0.5]

    def abstains(prompts, images, **kwargs):
        return [None, None]

    scores = score_images([brightness, abstains], ["a", "b"], images, {})
    assert torch.isnan(scores[:, 1]).all()
    with pytest.raises(
        ValueError, match=r"'broken' returned values that are NaN or infinite in float32 at positions \[0\]"
    ):
        score_images([brightness, broken], ["a", "b"], images, {})
