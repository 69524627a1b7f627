"""Masked text padding is trimmed at encoding (``DiffusionPolicy.padded_text``): every denoiser call reads fewer text
tokens (Qwen-Image pads to 512 beside 4,096 image tokens at 1024²), and predicts what it predicts from the padded
conditioning, CFG's two branches (trimmed to different lengths) included. The pipeline parity tests check the same
against diffusers' own sampler."""

import pytest
import torch

from trl_dance.policies import SamplerSettings, make_policy
from trl_dance.policies.prompts import TEXT_LENGTH_MULTIPLE, cat_padded, trim_padded_text
from trl_dance.testing import TINY_PIPELINES, TINY_VIDEO_FRAMES, tiny_condition_images

# Two prompts of different lengths: the batch keeps the longer one's tokens, the shorter one's stay masked.
PROMPTS = ["a red cat", "a blue dog on a wooden bench"]


def test_trimming_keeps_every_column_a_prompt_uses():
    mask = torch.zeros(2, 32, dtype=torch.long)
    mask[0, :3], mask[1, :11] = 1, 1
    embeds = torch.randn(2, 32, 4)
    trimmed = trim_padded_text({"e": embeds, "m": mask, "other": embeds}, {"e": "m"}, 8)
    assert trimmed["e"].shape == (2, 16, 4) and trimmed["m"].shape == (2, 16)  # 11 tokens, rounded up to 16
    assert torch.equal(trimmed["e"], embeds[:, :16]) and trimmed["other"] is embeds
    assert trim_padded_text({"e": embeds, "m": mask.flip(1)}, {"e": "m"}, 8)["e"].shape[1] == 32  # left padding
    assert trim_padded_text({"e": embeds, "m": mask * 0}, {"e": "m"}, 8)["e"].shape[1] == 0  # nothing valid
    assert trim_padded_text({"e": embeds[:, :5], "m": mask[:, :5]}, {"e": "m"}, 8)["e"].shape[1] == 5  # at most L
    joined = cat_padded([trimmed["m"], mask[:1, :4]])
    assert joined.shape == (3, 16) and joined[2].sum() == 3 and not joined[2, 4:].any()


def _policy(kind: str, guidance: float, negative_prompt: str | None, trim: bool):
    pipeline = TINY_PIPELINES[kind](0)
    if kind == "hunyuan-video15":
        from diffusers.guiders import ClassifierFreeGuidance

        pipeline.guider = ClassifierFreeGuidance(guidance_scale=guidance)
    video = {"num_frames": TINY_VIDEO_FRAMES} if kind.startswith(("hunyuan", "skyreels")) else {}
    settings = SamplerSettings(
        num_inference_steps=4, height=32, width=32, guidance_scale=guidance, negative_prompt=negative_prompt,
        max_sequence_length=64, **video,
    )  # fmt: skip
    policy = make_policy(pipeline, settings)
    policy.runtime.trim_text = trim
    return policy


@pytest.mark.parametrize(
    ("kind", "guidance", "negative_prompt"),
    [
        ("qwen-image", 4.0, None),  # CFG against the empty prompt: the branches trimmed to different lengths
        ("qwen-image-edit", 4.0, "blurry, dark"),  # per-sample negatives read with the source image
        ("hunyuan-video", 6.0, None),  # embedded guidance
        ("skyreels-i2v", 6.0, "blurry, dark"),
        ("hunyuan-video15", 6.0, None),  # two padded texts: Qwen2.5-VL's and ByT5's (none quoted: 0 tokens)
    ],
)
def test_trimmed_text_predicts_as_the_padded_text(kind, guidance, negative_prompt, small_edit_sources):
    columns = {"image": tiny_condition_images(2)} if kind in ("qwen-image-edit", "skyreels-i2v") else {}
    trimmed, padded = (_policy(kind, guidance, negative_prompt, trim) for trim in (True, False))
    short, full = trimmed.encode_prompts(PROMPTS, **columns), padded.encode_prompts(PROMPTS, **columns)
    for key, mask_key in trimmed.padded_text.items():
        if key not in full:
            continue
        length, valid = short[key].shape[1], int(full[mask_key].sum(dim=1).max())
        assert full[key].shape[1] == full[mask_key].shape[1] > length, key  # padding was cut
        assert length % TEXT_LENGTH_MULTIPLE == 0 and valid <= length < valid + TEXT_LENGTH_MULTIPLE, key
    latents = trimmed.initial_noise([torch.Generator().manual_seed(i) for i in range(2)])
    with torch.no_grad():
        for step in (2, 0):
            expected = padded.predict(padded.denoiser, latents, full, at=step)
            torch.testing.assert_close(
                trimmed.predict(trimmed.denoiser, latents, short, at=step), expected, rtol=0, atol=1e-5
            )
        # The comparison can fail: dropping the longer prompt's last token moves the prediction.
        key, mask_key = next(iter(trimmed.padded_text.items()))
        cut = dict(short)
        cut[mask_key] = short[mask_key].clone()
        cut[mask_key][1, int(short[mask_key][1].sum()) - 1] = 0
        moved = trimmed.predict(trimmed.denoiser, latents, cut, at=0)
    assert (moved - expected).abs().max() > 1e-3
