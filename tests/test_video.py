"""Video (Wan text-to-video): frame-wise rewards, learning, errors, media (the policy itself: test_policies.py)."""

import pytest
import torch
from conftest import (
    LEARNING_SEED,
    PROMPTS,
    assert_given_prefix_is_held,
    assert_learned,
    family_overrides,
    max_ratio_deviation,
    tiny_grpo_config,
)
from datasets import Dataset
from diffusers import DiffusionPipeline
from diffusers.utils import is_av_available
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer, DiffusionDPOConfig, DiffusionDPOTrainer
from trl_dance.rewards import get_reward_function, score_images, temporal_consistency
from trl_dance.testing import TINY_VIDEO_FRAMES, tiny_condition_images
from trl_dance.video import frame_indices, frame_strip
from trl_dance.visualization import _caption_font, _wrap, to_pil

WAN = family_overrides("wan")


def _dataset():
    return Dataset.from_dict({"prompt": PROMPTS})


def test_image_rewards_score_evenly_spaced_frames_and_average():
    videos = torch.rand(2, 9, 3, 4, 4)
    calls = []

    def first_pixel(prompts, images, tag):
        calls.append((list(prompts), images.shape, list(tag)))
        return images[:, 0, 0, 0]

    def whole_video(prompts, images, tag):
        return images.mean(dim=(1, 2, 3, 4))

    whole_video.accepts_video = True
    scores = score_images([first_pixel, whole_video], ["a", "b"], videos, {"tag": [1, 2]}, video_frames=3)
    frames = torch.tensor([0, 4, 8])
    assert calls == [(["a"] * 3 + ["b"] * 3, (6, 3, 4, 4), [1, 1, 1, 2, 2, 2])]
    torch.testing.assert_close(scores[:, 0], videos[:, frames, 0, 0, 0].mean(dim=1))
    torch.testing.assert_close(scores[:, 1], videos.mean(dim=(1, 2, 3, 4)))
    # Every frame when video_frames is None.
    all_frames = score_images([first_pixel], ["a", "b"], videos, {"tag": [1, 2]})
    torch.testing.assert_close(all_frames[:, 0], videos[:, :, 0, 0, 0].mean(dim=1))
    with pytest.raises(ValueError, match=r"returned 2 values for 6 frames \(3 per video\)"):
        score_images([lambda prompts, images: [0.0, 1.0]], ["a", "b"], videos, {}, video_frames=3)


def test_temporal_consistency_is_one_minus_the_mean_8bit_frame_change():
    still = torch.full((1, 4, 3, 8, 8), 100 / 255)
    flicker = still.clone()
    flicker[0, 1::2] = 151 / 255  # every other frame 51 levels brighter: every change is 51
    videos = torch.cat([still, flicker])
    assert get_reward_function("temporal_consistency") is temporal_consistency
    assert temporal_consistency(["a", "b"], videos) == pytest.approx([1.0, 1 - 51 / 255])
    # Whole videos reach it through score_images; an image batch is refused.
    scores = score_images([temporal_consistency], ["a", "b"], videos, {}, video_frames=2)
    torch.testing.assert_close(scores[:, 0], torch.tensor([1.0, 1 - 51 / 255]))
    with pytest.raises(ValueError, match="scores videos"):
        temporal_consistency(["a"], torch.rand(1, 3, 8, 8))


def test_frame_helpers():
    assert frame_indices(81, 8).tolist() == [0, 11, 23, 34, 46, 57, 69, 80]
    assert frame_indices(5, None).tolist() == frame_indices(5, 9).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=">= 1"):
        frame_indices(5, 0)
    videos = torch.rand(2, 5, 3, 8, 6)
    strip = frame_strip(videos, frames=3)  # frames 0, 2, 4 side by side
    assert strip.shape == (2, 3, 8, 18)
    torch.testing.assert_close(strip[..., 6:12], videos[:, 2])
    images = torch.rand(2, 3, 8, 8)
    assert frame_strip(images) is images
    assert [p.size for p in to_pil(videos, size=16)] == [(4 * 6 * 16 // 8, 16)] * 2


def test_grid_captions_keep_their_spaces_and_break_between_words():
    """Pillow's default font drew a space 2 px wide ("a catona sofa"); captions break between words, two lines."""
    font = _caption_font()
    assert font.getlength("a b") - font.getlength("ab") >= 3
    assert _wrap("a cat on a mat", len, 5, lines=2) == ["a cat", "on a…"]
    assert _wrap("abcdefghij kl", len, 4, lines=2) == ["abcd", "efg…"]  # a word wider than a line is cut
    assert _wrap("a sign", len, 20, lines=2) == ["a sign"] and _wrap("", len, 5, lines=2) == []


# Constant lr 1.5e-2, CFG 5, mean of the first 3 -> last 3 of 30 rollouts; the rewarded video is the last step's clean
# sample. Temporal consistency over seeds 42, 1, 2 and 1-2 torch threads: +0.0079 to +0.0221 (sample std 0.0015-0.0018),
# so the margin is 0.004 (half the smallest gain, 2.4 sample stds). At lr 3e-2 with CFG compressibility rose for 5
# rounds and fell back. The random Wan VAE's RMS norms leave the mean brightness of its videos nearly fixed.
def _learning_run(model_dir, tmp_path, reward, dataset, margin, **overrides) -> None:
    """30 GRPO rounds with CFG 5 on a tiny Wan; the mean reward of the last 3 rounds must exceed the first 3's by
    ``margin`` and by twice the first rollout's sample std."""
    settings = {
        "generation_batch_size": 32,
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 10,
        "max_steps": 30,
        "guidance_scale": 5.0,
        "learning_rate": 1.5e-2,
        "lr_scheduler_type": "constant",
        "seed": LEARNING_SEED,
        **WAN,
    }
    args = tiny_grpo_config(tmp_path, **(settings | overrides))
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_out"])
    trainer = DanceGRPOTrainer(model_dir, reward, args=args, train_dataset=dataset, peft_config=lora)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    initial_std = trainer.state.log_history[0]["reward_std"]
    print(f"{model_dir}: {reward} per round {rewards}")
    assert_learned(reward, first, last, initial_std, margin)


@pytest.mark.slow
def test_temporal_consistency_of_videos_rises(tiny_model_dir, tmp_path):
    """Learning on video: GRPO with CFG on the tiny Wan raises a whole-video reward (``accepts_video``)."""
    _learning_run(tiny_model_dir("wan"), tmp_path, "temporal_consistency", _dataset(), 0.004)


def _assert_refused(model_dir, tmp_path, match, **config):
    """DanceGRPOTrainer on ``model_dir`` with a prompt-only dataset raises ValueError matching ``match``."""
    with pytest.raises(ValueError, match=match):
        DanceGRPOTrainer(model_dir, "brightness", args=tiny_grpo_config(tmp_path, **config), train_dataset=_dataset())


def test_video_configuration_errors(tiny_model_dir, tmp_path):
    _assert_refused(tiny_model_dir("wan"), tmp_path, "num_frames must be 1 \\+ a multiple of 2", num_frames=4)
    _assert_refused(tiny_model_dir("flux"), tmp_path, "num_frames applies to video pipelines", **WAN)
    # The default 81 frames are 41 latent frames of the tiny VAE, more than its transformer's rotary tables cover.
    _assert_refused(
        tiny_model_dir("wan"), tmp_path, r"num_frames=81 gives 41 latent patches .* rope_max_seq_len \(32\)"
    )
    _assert_refused(
        tiny_model_dir("wan"),
        tmp_path,
        "pipeline_class must name a diffusers pipeline class, got 'WanModel'",
        pipeline_class="WanModel",
        **WAN,
    )
    with pytest.raises(ValueError, match="video_reward_frames must be >= 1"):
        tiny_grpo_config(tmp_path, video_reward_frames=0)
    dpo_args = DiffusionDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", resolution=32)
    pairs = Dataset.from_dict({"prompt": ["a"], "chosen": [None], "rejected": [None]})
    # Video DPO clips default to Wan's 81 frames, more than the tiny transformer's rotary table: named, with the fix.
    with pytest.raises(ValueError, match=r"num_frames=81 gives 41 latent patches .* use a smaller num_frames"):
        DiffusionDPOTrainer(tiny_model_dir("wan"), args=dpo_args, train_dataset=pairs)


def test_rollout_videos_reach_the_reward_and_the_model_card(tiny_model_dir, tmp_path):
    seen = []

    def record(prompts, images, **_):
        seen.append(images.shape)
        return images.mean(dim=(1, 2, 3, 4))

    record.accepts_video = True
    trainer = DanceGRPOTrainer(
        tiny_model_dir("wan"), record, args=tiny_grpo_config(tmp_path, max_steps=1, **WAN), train_dataset=_dataset()
    )
    trainer.train()
    assert seen == [(8, TINY_VIDEO_FRAMES, 3, 32, 32)]
    videos = trainer.generate_images(["a cat"])
    assert videos.shape == (1, TINY_VIDEO_FRAMES, 3, 32, 32)
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "pipeline_tag: text-to-video" in card and "WanPipeline" in card and f"{TINY_VIDEO_FRAMES} frames" in card


def _i2v_dataset():
    return Dataset.from_dict({"prompt": PROMPTS, "image": tiny_condition_images(len(PROMPTS))})


# Wan2.2-TI2V-5B's folder names WanPipeline; image-to-video loads it as a WanImageToVideoPipeline.
TI2V_AS_I2V = {"pipeline_class": "WanImageToVideoPipeline"}


@pytest.mark.parametrize(("kind", "load"), [("wan-i2v", {}), ("wan22-5b", TI2V_AS_I2V)])
def test_image_to_video_ratio_is_one_and_the_image_conditions_every_sample(tiny_model_dir, tmp_path, kind, load):
    """Wan I2V (2.1 layout: image latents as extra channels; 2.2 TI2V: as the first latent frame) with CFG: on-policy
    ratio 1; one encoding per (prompt, image); the image changes the prediction."""
    dataset = _i2v_dataset()
    trainer = DanceGRPOTrainer(
        tiny_model_dir(kind),
        "brightness",
        args=tiny_grpo_config(tmp_path, guidance_scale=5.0, share_initial_noise="none", **load, **WAN),
        train_dataset=dataset,
        peft_config=LoraConfig(
            r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"
        ),
    )
    rows = [dict(dataset[i]) for i in (0, 1) for _ in range(4)]
    rows[4]["image"] = rows[0]["image"]  # the second group's first sample takes the first group's image: a new pair
    trainer._generate_and_score(rows)
    cond, index = trainer._rollout["cond"], trainer._rollout["prompt_index"].tolist()
    assert index == [0, 0, 0, 0, 1, 2, 2, 2] and cond["image_condition"].shape[0] == 3
    assert max_ratio_deviation(trainer) < 1e-5

    latents = trainer.policy.initial_noise([torch.Generator().manual_seed(0)] * 2)
    images = [dataset[0]["image"], dataset[1]["image"]]
    with torch.no_grad():
        two_images = trainer.policy.encode_prompts(["a cat"] * 2, image=images)
        output = trainer.policy.predict(trainer.model, latents, two_images, at=torch.tensor([1, 1]))
    assert (output[0] - output[1]).abs().max() > 1e-3  # same prompt and noise, other image: other prediction
    if kind == "wan22-5b":
        _assert_the_first_frame_is_given(trainer, trainer._microbatch(trainer._microbatches[0]))
    trainer.create_model_card()
    assert "pipeline_tag: image-to-video" in (tmp_path / "README.md").read_text()


def _assert_the_first_frame_is_given(trainer, inputs):
    """Wan 2.2 TI2V: the first latent frame is the image's, not sampled: it stays as drawn through the trajectory,
    the log-probability ignores it, and every video of one image starts with the same frame (the VAE is causal),
    whatever its prompt and noise."""
    trajectory = trainer._rollout[
        "latents"
    ]  # (B, N, C, F', h, w): the states before each of the N − 1 stored steps, and after
    assert torch.equal(trajectory[:, 1:, :, :1], trajectory[:, :1, :, :1].expand_as(trajectory[:, 1:, :, :1]))
    with torch.no_grad():
        output = trainer.policy.predict(trainer.model, inputs["latents"], inputs["cond"], at=inputs["step_index"])
        moved = inputs["next_latents"].clone()
        moved[:, :, 0] += 1.0
        scores = [
            trainer.policy.step(output, inputs["latents"], inputs["step_index"], prev_sample=x).log_prob
            for x in (inputs["next_latents"], moved)
        ]
    torch.testing.assert_close(scores[0], scores[1], rtol=0, atol=0)
    # (B, F, 3, H, W): samples 0-4 have one image (4 with another prompt), 5-7 another; all have their own noise.
    videos = trainer._rollout["images"]
    torch.testing.assert_close(videos[1:5, 0], videos[:1, 0].expand(4, -1, -1, -1), rtol=0, atol=1e-6)
    assert (videos[5, 0] - videos[0, 0]).abs().amax() > 1e-2
    assert (videos[1:5, 1:] - videos[:1, 1:]).abs().amax() > 1e-2


def _flf_dataset():
    images = tiny_condition_images(2 * len(PROMPTS))
    return Dataset.from_dict({"prompt": PROMPTS, "image": images[::2], "last_image": images[1::2]})


@pytest.mark.parametrize("kind", ["wan-flf2v", "wan22-i2v"])
def test_first_last_frame_video(tiny_model_dir, tmp_path, kind):
    """First and last frames given (their parity with the pipeline's ``last_image`` is in test_policies): Wan 2.1
    FLF2V requires the ``last_image`` column; Wan 2.2 A14B takes it where the rows have one (image-to-video without).
    The on-policy ratio is 1 with CFG, and the last image changes the prediction of the same prompt, first image and
    noise."""
    dataset = _flf_dataset()
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian")
    # (Wan 2.2: the low-noise expert's steps 2-4, one micro-batch of 8 samples per step)
    experts = {"train_expert": "low_noise", "timestep_fraction": 0.6, "gradient_accumulation_steps": 3}
    experts = experts if kind == "wan22-i2v" else {}
    args = tiny_grpo_config(tmp_path, guidance_scale=5.0, **experts, **WAN)
    trainer = DanceGRPOTrainer(tiny_model_dir(kind), "brightness", args=args, train_dataset=dataset, peft_config=lora)
    assert trainer.policy.condition_columns == ("image", "last_image")
    trainer._generate_and_score([dict(dataset[i]) for i in (0, 1) for _ in range(4)])
    if kind == "wan-flf2v":
        assert trainer._rollout["cond"]["image_embeds"].shape[:2] == (2, 2 * 17)  # both images' CLIP tokens
    assert max_ratio_deviation(trainer) < 1e-5
    latents = trainer.policy.initial_noise([torch.Generator().manual_seed(0)] * 2)
    first, lasts = [dataset[0]["image"]] * 2, [dataset[0]["last_image"], dataset[1]["last_image"]]
    with torch.no_grad():
        cond = trainer.policy.encode_prompts(["a cat"] * 2, image=first, last_image=lasts)
        output = trainer.policy.predict(trainer.model, latents, cond, at=torch.tensor([1, 1]))
    assert (output[0] - output[1]).abs().max() > 1e-3
    if kind == "wan22-i2v":  # without the column: image-to-video
        trainer = DanceGRPOTrainer(tiny_model_dir(kind), "brightness", args=args, train_dataset=_i2v_dataset())
        assert trainer.policy.condition_columns == ("image",)
        return
    match = r"conditions every sample on the dataset columns \['last_image'\]"
    with pytest.raises(ValueError, match=match):
        DanceGRPOTrainer(tiny_model_dir("wan-flf2v"), "brightness", args=args, train_dataset=_i2v_dataset())


@pytest.mark.parametrize("kind", ["ltx2-i2v", "ltx2-condition"])
def test_ltx2_image_to_video(tiny_model_dir, tmp_path, kind):
    """LTX-2 image-to-video, and frame conditions (LTX2ConditionPipeline: the first frame and a keyframe at the last
    latent frame, appended as tokens; parity with the pipelines is in test_policies): ratio 1 with every guidance
    term; the given tokens carry over through the trajectory and are not scored; the image (and the keyframe) change
    the prediction; routed rewards see a video stream without the given tokens; the image's H.264 re-compression
    without PyAV is refused at construction, naming the setting that skips it."""
    pipeline_kwargs = {"image_crf": 0, "spatio_temporal_guidance_blocks": [1]}
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian")
    args = tiny_grpo_config(tmp_path, guidance_scale=3.0, pipeline_kwargs=pipeline_kwargs, **family_overrides("ltx2"))
    dataset = _flf_dataset() if kind == "ltx2-condition" else _i2v_dataset()
    trainer = DanceGRPOTrainer(tiny_model_dir(kind), "brightness", args=args, train_dataset=dataset, peft_config=lora)
    policy, g = trainer.policy, trainer.policy.geometry
    trainer._generate_and_score([dict(dataset[i]) for i in (0, 1) for _ in range(4)])
    assert max_ratio_deviation(trainer) < 1e-5
    given = (g.keyframes + 1) * g.height * g.width * g.video_channels  # (with keyframes, theirs come first)
    assert g.keyframes == (kind == "ltx2-condition")
    assert_given_prefix_is_held(trainer, given)
    with torch.no_grad():
        latents = policy.initial_noise([torch.Generator().manual_seed(0)] * 2)
        same_last = {"last_image": [dataset[0]["last_image"]] * 2} if kind == "ltx2-condition" else {}
        cond = policy.encode_prompts(["a cat"] * 2, image=[dataset[0]["image"], dataset[1]["image"]], **same_last)
        output = policy.predict(trainer.model, latents, cond, at=torch.tensor([1, 1]))
        if kind == "ltx2-condition":  # the same first image, another last one
            keyframes = policy.encode_prompts(
                ["a cat"] * 2,
                image=[dataset[0]["image"]] * 2,
                last_image=[dataset[0]["last_image"], dataset[1]["last_image"]],
            )
            other = policy.predict(trainer.model, latents, keyframes, at=torch.tensor([1, 1]))
            assert (other[0] - other[1]).abs().max() > 1e-3
    assert (output[0] - output[1]).abs().max() > 1e-3  # same prompt and noise, other image: other prediction
    assert policy.streams == {"video": policy.layout.streams["video"] - given, "audio": policy.layout.streams["audio"]}
    if is_av_available():
        return
    default_crf = tiny_grpo_config(tmp_path, **family_overrides("ltx2"))
    with pytest.raises(
        ValueError, match=r"needs PyAV: `pip install av`, or skip it with pipeline_kwargs \{image_crf: 0\}"
    ):
        DanceGRPOTrainer(tiny_model_dir(kind), "brightness", args=default_crf, train_dataset=dataset)


# LTX-2 with a first frame and a last-frame keyframe given, the video unguided (as LTX-2's brightness test), 8 rounds
# of 16 videos, 2 of 5 steps trained: brightness +0.042 / +0.026 / +0.028 over seeds 42, 1, 2 (sample std 0.003-0.012;
# with all 5 steps and 32 videos +0.041 / +0.039 / +0.049, at three times the cost); margin the smallest / 2.3.
@pytest.mark.slow
def test_ltx2_keyframed_video_brightness_rises(tiny_model_dir, tmp_path):
    """Learning with frame conditions (LTX2ConditionPipeline): the generated frames between the given first frame
    and the last-frame keyframe get brighter."""
    unguided = {"stg_scale": 0.0, "modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_scale": 1.0}
    args = tiny_grpo_config(
        tmp_path, generation_batch_size=16, per_device_train_batch_size=16, gradient_accumulation_steps=2,
        timestep_fraction=0.4, max_steps=8, guidance_scale=1.0, pipeline_kwargs={**unguided, "image_crf": 0}, seed=LEARNING_SEED,
        **family_overrides("ltx2"),
    )  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_out"])
    trainer = DanceGRPOTrainer(
        tiny_model_dir("ltx2-condition"), "brightness", args=args, train_dataset=_flf_dataset(), peft_config=lora
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print(f"ltx2-condition: brightness per round {rewards}")
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert_learned("brightness", first, last, trainer.state.log_history[0]["reward_std"], 0.011)


def test_image_to_video_needs_its_image_column(tiny_model_dir, tmp_path):
    match = r"conditions every sample on the dataset columns \['image'\]"
    _assert_refused(tiny_model_dir("wan-i2v"), tmp_path, match, **WAN)


# Over seeds 42, 1, 2 and 1-2 threads (constant lr 1.5e-2, CFG 5, first 3 -> last 3 of 30 rollouts): Wan 2.1 layout
# +0.181 to +0.278 kB (sample std 0.010-0.012), in 20 rollouts +0.085 / +0.161 / +0.119 (what the test runs; margin
# the smallest / 2.3); Wan 2.2 TI2V layout, whose first frame is the image's and cannot change
# and whose VAE leaves 2×2 tokens per latent frame, +0.033 to +0.046 kB (sample std 0.005).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "load", "rise"), [("wan-i2v", {"max_steps": 20}, 0.037), ("wan22-5b", TI2V_AS_I2V, 0.012)]
)
def test_image_to_video_jpeg_compressibility_rises(tiny_model_dir, tmp_path, kind, load, rise):
    """Learning on image-to-video: GRPO with CFG raises the frame-averaged JPEG compressibility of videos that
    start from the dataset's images."""
    dataset = _i2v_dataset()
    _learning_run(tiny_model_dir(kind), tmp_path, "jpeg_compressibility", dataset, rise, **load)


# The tiny Wan 2.2's 6-step schedule (shift 3): steps 0-1 have timesteps >= 875 (high-noise expert), 2-5 below.
@pytest.mark.parametrize(
    ("kind", "train_expert", "fraction", "steps"),
    [
        ("wan22", "high_noise", 0.4, [0, 1]),
        ("wan22", "low_noise", 0.6, [2, 3, 4]),
        ("wan22-i2v", "low_noise", 0.6, [2, 3, 4]),
    ],
)
def test_two_expert_wan_trains_one_expert_on_its_own_steps(
    tiny_model_dir, tmp_path, kind, train_expert, fraction, steps
):
    """Wan 2.2 A14B (T2V, I2V): rollouts go through both experts, transitions only through the trained one's steps
    (ratio 1 there), the frozen expert does not change, and the LoRA reloads into the right transformer."""
    args = tiny_grpo_config(
        tmp_path,
        guidance_scale=5.0,
        guidance_scale_2=3.0,
        train_expert=train_expert,
        timestep_fraction=fraction,
        per_device_train_batch_size=len(steps) * 4,
        max_steps=1,
        gradient_accumulation_steps=2,
        **WAN,
    )
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian")
    dataset = _i2v_dataset() if kind.endswith("i2v") else _dataset()
    trainer = DanceGRPOTrainer(tiny_model_dir(kind), "brightness", args=args, train_dataset=dataset, peft_config=lora)
    pipeline = trainer.policy.pipeline
    trained, frozen = (
        (pipeline.transformer, pipeline.transformer_2)
        if train_expert == "high_noise"
        else (pipeline.transformer_2, pipeline.transformer)
    )
    assert trainer.model is trained and trainer.policy.trainable_steps() == steps
    assert not any(p.requires_grad for p in frozen.parameters())
    frozen_before = {k: v.clone() for k, v in frozen.state_dict().items()}

    trainer._generate_and_score([dict(trainer.train_dataset[i]) for i in (0, 1) for _ in range(4)])
    planned = torch.cat([plan[1] for plan in trainer._microbatches])
    assert sorted(set(planned.tolist())) == steps and len(planned) == 8 * len(steps)
    assert max_ratio_deviation(trainer) < 1e-5

    trainer.train()
    assert all(torch.equal(v, frozen_before[k]) for k, v in frozen.state_dict().items())
    trainer.save_model(str(tmp_path / "lora"))
    reloaded = DiffusionPipeline.from_pretrained(tiny_model_dir(kind))
    reloaded.load_lora_weights(str(tmp_path / "lora"), load_into_transformer_2=train_expert == "low_noise")
    latents = trainer.policy.initial_noise([torch.Generator().manual_seed(i) for i in range(2)])
    index = torch.tensor(steps[:2])
    columns = {"image": dataset["image"][:2]} if kind.endswith("i2v") else {}
    cond = trainer.policy.encode_prompts(dataset["prompt"][:2], **columns)
    with torch.no_grad():
        expected = trainer.policy.predict(trainer.model, latents, cond, at=index)
        got = trainer.policy.predict(getattr(reloaded, trainer.policy.denoiser_name), latents, cond, at=index)
        untouched = getattr(reloaded, "transformer" if train_expert == "low_noise" else "transformer_2")
        assert not getattr(untouched, "_hf_peft_config_loaded", False)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert ("load_into_transformer_2=True" in card) == (train_expert == "low_noise")


def test_two_expert_wan_configuration_errors(tiny_model_dir, tmp_path):
    _assert_refused(
        tiny_model_dir("wan22"),
        tmp_path,
        r"the high_noise expert serves only 2 \(\[0, 1\]\); use timestep_fraction <= 0.400",
        **WAN,
    )
    _assert_refused(
        tiny_model_dir("wan"), tmp_path, "apply to two-expert Wan 2.2 pipelines", train_expert="low_noise", **WAN
    )
    with pytest.raises(ValueError, match="train_expert must be one of"):
        tiny_grpo_config(tmp_path, train_expert="both")
    _assert_refused(
        tiny_model_dir("wan"),
        tmp_path,
        "offload_frozen_expert applies to two-expert",
        offload_frozen_expert=True,
        **WAN,
    )


def test_an_offloaded_frozen_expert_moves_once_each_way_per_round(tiny_model_dir, tmp_path):
    """offload_frozen_expert: the frozen expert goes to the accelerator for a round's rollouts (all its chunks) and
    back to the CPU, and training never moves it."""
    args = tiny_grpo_config(
        tmp_path,
        train_expert="low_noise",
        timestep_fraction=0.6,
        offload_frozen_expert=True,
        rollout_batch_size=2,
        gradient_accumulation_steps=3,  # 8 videos x 3 low-noise steps / 8: 3 micro-batches per round
        **WAN,
    )
    trainer = DanceGRPOTrainer(tiny_model_dir("wan22"), "brightness", args=args, train_dataset=_dataset())
    policy = trainer.policy
    frozen = policy.frozen_expert
    assert frozen is policy.pipeline.transformer and policy.offloaded_modules() == [frozen]
    assert next(frozen.parameters()).device.type == "cpu"
    moves, move = [], frozen.to
    frozen.to = lambda device: moves.append(str(device)) or move(device)

    trainer._generate_and_score([dict(trainer.train_dataset[i]) for i in (0, 1) for _ in range(4)])  # 4 chunks
    assert moves == [str(policy.device), "cpu"]
    trainer.generate_images(["a cat"])
    assert moves == [str(policy.device), "cpu"] * 2
    trainer.compute_loss(trainer.model, trainer._microbatch(trainer._microbatches[0])).backward()
    assert len(moves) == 4 and policy.runtime.sampling_depth == 0


# Over seeds 42, 1, 2 and 1-2 threads (constant lr 1.5e-2, CFG 5 / 3, the low-noise expert's 3 trainable steps, first
# 3 -> last 3 of 30 rollouts): +0.135 to +0.197 kB (sample std 0.009-0.010).
@pytest.mark.slow
def test_two_expert_wan_low_noise_expert_learns(tiny_model_dir, tmp_path):
    """Learning with two experts: training only the low-noise expert on its own steps, with the frozen high-noise
    expert drawing the first steps of every rollout, raises JPEG compressibility."""
    _learning_run(
        tiny_model_dir("wan22"),
        tmp_path,
        "jpeg_compressibility",
        _dataset(),
        0.05,
        train_expert="low_noise",
        guidance_scale_2=3.0,
        timestep_fraction=0.6,
        gradient_accumulation_steps=6,
    )


def test_ltx2_soundtracks_reach_audio_rewards(tiny_model_dir, tmp_path):
    """LTX-2's rollouts carry their soundtracks: a reward with ``accepts_audio`` gets them (B, channels, samples) at the
    vocoder's rate with the videos whole, beside an image reward scoring frames; families without audio refuse it."""
    seen = {}

    def loudness(prompts, images, audio, audio_sample_rate, **_):
        seen.update(images=images.shape, audio=audio.shape, rate=audio_sample_rate)
        return audio.pow(2).mean(dim=(1, 2)).sqrt()

    loudness.accepts_audio = True
    args = tiny_grpo_config(tmp_path, max_steps=1, guidance_scale=3.0, **family_overrides("ltx2"))
    trainer = DanceGRPOTrainer(tiny_model_dir("ltx2"), [loudness, "brightness"], args=args, train_dataset=_dataset())
    trainer.train()
    pipeline = trainer.policy.pipeline
    assert seen["images"] == (8, TINY_VIDEO_FRAMES, 3, 32, 32)
    assert seen["audio"][:2] == (8, pipeline.vocoder.config.out_channels) and seen["audio"][2] > 0
    assert seen["rate"] == pipeline.vocoder.config.output_sampling_rate == 24000
    assert trainer.state.log_history[0]["rewards/loudness/mean"] > 0
    silent = DanceGRPOTrainer(tiny_model_dir("ltx2"), "brightness", args=args, train_dataset=_dataset())
    generators = [torch.Generator().manual_seed(0)]
    assert "audio" not in silent.sample(["a cat"], generators)  # decoded only for rewards that score it
    assert silent.sample(["a cat"], generators)["images"].shape == (1, TINY_VIDEO_FRAMES, 3, 32, 32)
    pairs = Dataset.from_dict({"prompt": ["a"], "chosen": [None], "rejected": [None]})
    dpo_args = DiffusionDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", resolution=32)
    with pytest.raises(ValueError, match="denoises each video with its soundtrack"):
        DiffusionDPOTrainer(tiny_model_dir("ltx2"), args=dpo_args, train_dataset=pairs)
    with pytest.raises(ValueError, match=r"rewards \['loudness'\] score audio, which WanPipeline does not generate"):
        DanceGRPOTrainer(
            tiny_model_dir("wan"), loudness, args=tiny_grpo_config(tmp_path, **WAN), train_dataset=_dataset()
        )
