"""HPSv3 and VideoAlign on tiny Qwen2-VL checkpoints in the published layouts, against transformers' own Qwen2-VL
forward and image processor (not the adapters' code paths)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from reward_checkpoints import legacy_qwen2_vl_state_dict, qwen2_vl_reward_model, save_tiny_qwen2_vl
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from trl_dance.rewards import HPSv3Reward, VideoAlignReward, get_reward_function, score_images
from trl_dance.rewards.hpsv3 import ranknet_head
from trl_dance.rewards.image_transforms import to_uint8
from trl_dance.rewards.qwen2_vl import patchify, prompt_template, qwen_size
from trl_dance.rewards.video_align import sampled_frames

PROMPTS = ["a cat", "a red house by the sea", "blue sky"]
VIDEO_TOKENS = ["<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"]
STATS = {"VQ_mean": 3.6, "VQ_std": 2.2, "MQ_mean": 1.1, "MQ_std": 1.4, "TA_mean": 2.8, "TA_std": 2.5}
EXCLUDE = ["lm_head", "rm_head", "embed_tokens", "visual"]


def _images(count=3, height=64, width=64, seed=0):
    return torch.rand((count, 3, height, width), generator=torch.Generator().manual_seed(seed))


def _videos(count=2, frames=9, seed=0):
    """Noise videos of distinct brightness (the scores of similar noise videos differ little)."""
    noise = torch.rand((count, frames, 3, 64, 96), generator=torch.Generator().manual_seed(seed))
    return noise * torch.linspace(0.2, 1.0, count).view(count, 1, 1, 1, 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("qwen2-vl-rewards")
    base = save_tiny_qwen2_vl(str(root / "qwen2-vl"))

    hps, hps_tokenizer = qwen2_vl_reward_model(base, ["<|Reward|>"], lambda: ranknet_head(32), seed=1)
    (root / "hpsv3").mkdir()
    from safetensors.torch import save_file

    save_file(legacy_qwen2_vl_state_dict(hps), str(root / "hpsv3" / "HPSv3.safetensors"))

    video, video_tokenizer = qwen2_vl_reward_model(
        base, VIDEO_TOKENS, lambda: torch.nn.Linear(32, 1, bias=False), seed=2
    )
    targets = [
        name
        for name, module in video.named_modules()
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding) and not any(word in name for word in EXCLUDE)
    ]
    video = get_peft_model(video, LoraConfig(target_modules=targets, r=4, lora_alpha=8))
    with torch.no_grad():  # a trained adapter: B ≠ 0, so a wrongly loaded LoRA changes the scores
        for name, parameter in video.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    video.eval()
    state = {}
    for key, value in legacy_qwen2_vl_state_dict(video.base_model.model).items():
        state[f"base_model.model.{key}"] = value  # the reference saves the PEFT model's state dict
    directory = root / "videoalign"
    (directory / "checkpoint-7").mkdir(parents=True)
    torch.save(state, directory / "checkpoint-7" / "model.pth")
    settings = {
        "data_config": {
            "max_frame_pixels": 3000,
            "fps": 2.0,
            "num_frames": None,
            "eval_dim": ["VQ", "MQ", "TA"],
            "prompt_template_type": "detailed_special",
            "sample_type": "uniform",
        },
        "model_config": {
            "model_name_or_path": base,
            "output_dim": 1,
            "use_special_tokens": True,
            "reward_token": "special",
        },
        "peft_lora_config": {
            "lora_enable": True,
            "vision_lora": False,
            "lora_r": 4,
            "lora_alpha": 8,
            "lora_namespan_exclude": EXCLUDE,
            "num_lora_modules": -1,
            "use_rslora": False,
        },
        "inference_config": STATS,
    }
    (directory / "model_config.json").write_text(json.dumps(settings))
    return {
        "base": base,
        "hps": (hps, hps_tokenizer, str(root / "hpsv3")),
        "video": (video, video_tokenizer, str(directory)),
    }


def _reference_hidden(model, tokenizer, texts, pad, pixel_values, grid, kind):
    """transformers' Qwen2VLModel forward with positions 0..L−1 on every M-RoPE axis, as the references' forward."""
    merged = [int(g.prod()) // 4 for g in grid]
    texts = [t.replace(pad, pad * n) for t, n in zip(texts, merged)]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    ids = encoded["input_ids"]
    positions = torch.arange(ids.shape[1]).expand(3, ids.shape[0], -1)
    vision = {"pixel_values": pixel_values, "image_grid_thw": grid} if kind == "image" else {}
    if kind == "video":
        vision = {"pixel_values_videos": pixel_values, "video_grid_thw": grid}
    with torch.no_grad():
        hidden = model.model(
            input_ids=ids, attention_mask=encoded["attention_mask"], position_ids=positions, **vision
        ).last_hidden_state
    return hidden, ids


def _chat(tokenizer, kind, text):
    message = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": text}]}]
    return tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)


def test_hpsv3_matches_reference_forward(checkpoints):
    model, tokenizer, path = checkpoints["hps"]
    images = _images()
    reward = HPSv3Reward(path, base_model=checkpoints["base"], dtype=torch.float32)
    scores = torch.tensor(reward(PROMPTS, images))

    # qwen-vl-utils: PIL resize (bicubic) to 448×448 (min = max = 256·28² pixels), then the Qwen2-VL processor.
    processor = Qwen2VLImageProcessorPil.from_pretrained(checkpoints["base"])
    pil = [Image.fromarray(array).resize((448, 448), Image.BICUBIC) for array in to_uint8(images)]
    batch = processor(images=pil, return_tensors="pt")
    texts = [_chat(tokenizer, "image", prompt_template("hpsv3").format(text_prompt=p)) for p in PROMPTS]
    hidden, ids = _reference_hidden(
        model, tokenizer, texts, "<|image_pad|>", batch["pixel_values"], batch["image_grid_thw"], "image"
    )
    with torch.no_grad():
        expected = model.rm_head(hidden[ids == tokenizer.convert_tokens_to_ids("<|Reward|>")].float())[:, 0]
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    assert scores.std() > 1e-3  # distinct inputs, distinct scores
    assert "Textual prompt - a cat\n" in texts[0] and "<|Reward|>" in texts[0]


def test_patchify_matches_qwen2_vl_image_processor():
    images = _images(count=2, height=56, width=84, seed=3)
    processor = Qwen2VLImageProcessorPil()
    pil = [Image.fromarray(array) for array in to_uint8(images)]
    expected = processor(images=pil, return_tensors="pt")
    pixels = torch.from_numpy(to_uint8(images)).permute(0, 3, 1, 2).float() / 255
    mean, std = (torch.tensor(v).view(1, 1, 3, 1, 1) for v in (processor.image_mean, processor.image_std))
    values, grid = patchify((pixels.unsqueeze(1) - mean) / std, 14, 2, 2)
    torch.testing.assert_close(values, expected["pixel_values"], atol=1e-5, rtol=0)
    assert grid.tolist() == expected["image_grid_thw"].tolist() == [[1, 4, 6]] * 2


def test_qwen_resize_geometry():
    pixels = 256 * 28 * 28
    assert qwen_size(512, 512, pixels, pixels) == (448, 448)  # the reference's square images
    # 48×80: rounded 56×84 is below the minimum, so both sides scale by √(200704 / 3840) and round up to 28s.
    assert qwen_size(48, 80, pixels, pixels) == (364, 588)
    assert qwen_size(720, 1280, pixels, pixels) == (336, 588)


def test_videoalign_frame_sampling():
    # qwen-vl-utils at 2 fps: 9 frames of an 8-fps video (1.125 s) → 2.25 frames → at least 4 → 4, evenly spread.
    assert sampled_frames(9, 8.0, 2.0, None) == [0, 3, 5, 8]
    assert sampled_frames(81, 16.0, 2.0, None) == torch.linspace(0, 80, 10).round().long().tolist()
    assert sampled_frames(81, 16.0, None, 6) == [0, 16, 32, 48, 64, 80]
    assert sampled_frames(3, 16.0, 2.0, None) == [0, 2]  # the even count ≤ 3
    with pytest.raises(ValueError, match="at least 2 frames"):
        sampled_frames(1, 16.0, 2.0, None)


def _video_reference(checkpoints, videos, prompts):
    """VQ, MQ, TA of the reference: frames [0, 3, 5, 8], 8-bit resize (torchvision's uint8 bicubic) to 28×56 (3000
    pixels at most), Qwen2-VL's patches with two frames per time slice, the PEFT model (LoRA unmerged)."""
    model, tokenizer, _ = checkpoints["video"]
    frames = torch.from_numpy(to_uint8(videos[:, [0, 3, 5, 8]].flatten(0, 1))).permute(0, 3, 1, 2).float()
    frames = F.interpolate(frames, size=(28, 56), mode="bicubic", antialias=True).clamp(0, 255).round() / 255
    processor = Qwen2VLImageProcessorPil.from_pretrained(checkpoints["base"])
    mean, std = (torch.tensor(v).view(1, 1, 3, 1, 1) for v in (processor.image_mean, processor.image_std))
    values, grid = patchify((frames.view(len(prompts), 4, 3, 28, 56) - mean) / std, 14, 2, 2)
    texts = [_chat(tokenizer, "video", prompt_template("videoalign").format(text_prompt=p)) for p in prompts]
    hidden, ids = _reference_hidden(model.base_model.model, tokenizer, texts, "<|video_pad|>", values, grid, "video")
    special = torch.isin(ids, torch.tensor(tokenizer.convert_tokens_to_ids(VIDEO_TOKENS)))
    with torch.no_grad():
        raw = model.base_model.model.rm_head(hidden[special]).view(len(prompts), 3)
    mean = torch.tensor([STATS[f"{d}_mean"] for d in ("VQ", "MQ", "TA")])
    std = torch.tensor([STATS[f"{d}_std"] for d in ("VQ", "MQ", "TA")])
    return (raw - mean) / std


def test_videoalign_matches_reference_forward(checkpoints):
    videos = _videos()
    reward = VideoAlignReward(checkpoints["video"][2], video_fps=8.0, dtype=torch.float32)
    expected = _video_reference(checkpoints, videos, PROMPTS[:2])
    torch.testing.assert_close(reward.dimensions(PROMPTS[:2], videos).float(), expected, atol=1e-4, rtol=1e-4)
    overall = torch.tensor(reward(PROMPTS[:2], videos))
    torch.testing.assert_close(overall, expected.sum(dim=1), atol=3e-4, rtol=1e-4)
    assert (expected[0] - expected[1]).abs().min() > 3e-3  # ≥ 30× the tolerance on every dimension (measured 9e-3)

    motion = VideoAlignReward(checkpoints["video"][2], dimension="MQ", video_fps=8.0, dtype=torch.float32)
    torch.testing.assert_close(torch.tensor(motion(PROMPTS[:2], videos)), expected[:, 1], atol=1e-4, rtol=1e-4)
    with checkpoints["video"][0].disable_adapter():  # the LoRA matters: a loader that dropped it would fail above
        assert (_video_reference(checkpoints, videos, PROMPTS[:2]) - expected).abs().max() > 1e-2
    # As the trainers call it: whole videos, not frames.
    scored = score_images([reward], PROMPTS[:2], videos, {}, video_frames=2)
    torch.testing.assert_close(scored[:, 0], overall.float(), atol=1e-6, rtol=0)
    assert get_reward_function("videoalign", checkpoint=checkpoints["video"][2]).accepts_video


def test_videoalign_loads_adapter_and_non_lora_files(checkpoints, tmp_path):
    """The reference's other checkpoint form: ``adapter_model.safetensors`` (LoRA, no adapter name) and
    ``non_lora_state_dict.pth`` (everything else): same scores."""
    from safetensors.torch import save_file

    model_dir = checkpoints["video"][2]
    state = torch.load(f"{model_dir}/checkpoint-7/model.pth", weights_only=True)
    adapter = {k.replace(".default.", "."): v for k, v in state.items() if "lora_" in k}
    (tmp_path / "checkpoint-3").mkdir()
    save_file(adapter, str(tmp_path / "checkpoint-3" / "adapter_model.safetensors"))
    torch.save(
        {k: v for k, v in state.items() if "lora_" not in k}, tmp_path / "checkpoint-3" / "non_lora_state_dict.pth"
    )
    (tmp_path / "model_config.json").write_bytes((Path(model_dir) / "model_config.json").read_bytes())
    videos = _videos(seed=4)
    split = VideoAlignReward(str(tmp_path), video_fps=8.0, dtype=torch.float32)(PROMPTS[:2], videos)
    full = VideoAlignReward(model_dir, video_fps=8.0, dtype=torch.float32)(PROMPTS[:2], videos)
    torch.testing.assert_close(torch.tensor(split), torch.tensor(full), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("name", "eps", "tolerance"), [("hpsv3", 1e-4, 1e-2), ("videoalign", 1e-3, 2e-3)])
def test_score_gradient_matches_finite_differences(checkpoints, name, eps, tolerance):
    """Reward backpropagation through the Qwen2-VL rewards: the directional derivative of Σ score equals central
    differences. Looser than the CLIP rewards' 1e-6: Qwen2's RMSNorm computes in float32 even in a float64 model, and
    HPSv3's ReLU head has kinks the differences cross (measured relative errors over 4 random checkpoints × 2 inputs:
    HPSv3 ≤ 7.7e-4 at eps 1e-4, up to 1.4e-1 at 1e-3; VideoAlign 1.6e-4 at 1e-3, 1.5e-3 at 1e-4)."""
    if name == "hpsv3":
        reward = HPSv3Reward(checkpoints["hps"][2], base_model=checkpoints["base"], dtype=torch.float64)
        inputs = _images(count=2, seed=5).double()
    else:
        reward = VideoAlignReward(checkpoints["video"][2], video_fps=8.0, dtype=torch.float64)
        inputs = _videos(seed=5).double()
    inputs = (inputs * 0.8 + 0.1).requires_grad_(True)
    direction = torch.randn(inputs.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    reward.score(PROMPTS[:2], inputs).sum().backward()
    analytic = (inputs.grad * direction).sum().item()
    with torch.no_grad():
        plus = reward.score(PROMPTS[:2], inputs + eps * direction).sum().item()
        minus = reward.score(PROMPTS[:2], inputs - eps * direction).sum().item()
    numeric = (plus - minus) / (2 * eps)
    assert abs(numeric) > 1e-2
    assert abs(analytic - numeric) <= tolerance * abs(numeric)


def test_bad_inputs_and_unsupported_checkpoints(checkpoints, tmp_path):
    videos = _videos()
    reward = VideoAlignReward(checkpoints["video"][2], video_fps=8.0, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"videos must be a tensor of shape \(B, F, 3, H, W\)"):
        reward(PROMPTS[:2], videos[:, 0])
    with pytest.raises(ValueError, match="got 3 prompts for 2 videos"):
        reward(PROMPTS, videos)
    with pytest.raises(ValueError, match="unknown dimension"):
        VideoAlignReward(checkpoints["video"][2], dimension="motion")
    settings = json.loads((Path(checkpoints["video"][2]) / "model_config.json").read_text())
    settings["data_config"]["prompt_template_type"] = "simple"
    (tmp_path / "model_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="prompt_template_type = 'simple' is not supported"):
        VideoAlignReward(str(tmp_path))(PROMPTS[:2], videos)
    hps = HPSv3Reward(checkpoints["hps"][2], base_model=checkpoints["base"], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"images must be a tensor of shape \(B, 3, H, W\)"):
        hps(PROMPTS[:2], videos)
