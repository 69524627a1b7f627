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
