"""Neural reward adapters on tiny offline checkpoints in the published formats, against independent forwards."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference_packages import hpsv2_package_model, load_image_reward_package, open_clip_model
from reward_checkpoints import (
    TINY_BLIP,
    TINY_HPS,
    TINY_IMAGE_REWARD,
    TINY_OPEN_CLIP,
    aesthetic_head_state_dict,
    image_reward_raw,
    image_reward_state_dict,
    open_clip_image_features,
    open_clip_state_dict,
    open_clip_text_features,
    save_bert_tokenizer,
    save_clip_tokenizer,
    save_open_clip_bpe_tokenizer,
    save_tiny_clip,
)
from transformers import AutoTokenizer, CLIPModel

from trl_dance.rewards import (
    AestheticReward,
    CLIPScore,
    HPSv2Reward,
    ImageReward,
    PickScore,
    get_reward_function,
)
from trl_dance.rewards.image_reward import IMAGE_REWARD_MEAN, IMAGE_REWARD_STD
from trl_dance.rewards.image_transforms import CLIP_MEAN, CLIP_STD, reference_pixels, to_uint8

PROMPTS = ["a cat", "a red house by the sea", "blue sky", "an old car, parked", "sunset"]


def _images(count=5, height=48, width=40, seed=0):
    return torch.rand((count, 3, height, width), generator=torch.Generator().manual_seed(seed))


def _normalize(x):
    return x / x.norm(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward-checkpoints")
    paths = {"clip_tokenizer": save_clip_tokenizer(str(root / "clip-tokenizer"))}
    paths["bert_tokenizer"] = save_bert_tokenizer(str(root / "bert-tokenizer"))
    paths["hps_state"] = open_clip_state_dict(TINY_OPEN_CLIP, seed=1)
    (root / "hps").mkdir()
    torch.save({"state_dict": paths["hps_state"]}, root / "hps" / "HPS_v2.1_compressed.pt")
    paths["hps"] = str(root / "hps")
    paths["image_reward_state"] = image_reward_state_dict(TINY_BLIP, seed=2)
    torch.save(paths["image_reward_state"], root / "ImageReward.pt")
    paths["image_reward"] = str(root / "ImageReward.pt")
    paths["clip"] = save_tiny_clip(str(root / "clip"), seed=3)
    paths["aesthetic_state"] = aesthetic_head_state_dict(TINY_OPEN_CLIP["projection_dim"], seed=4)
    torch.save(paths["aesthetic_state"], root / "sac+logos+ava1-l14-linearMSE.pth")
    paths["aesthetic"] = str(root / "sac+logos+ava1-l14-linearMSE.pth")
    return paths


def _build(name, paths, **kwargs):
    if name == "hpsv2":
        return HPSv2Reward(paths["hps"], tokenizer=paths["clip_tokenizer"], architecture=TINY_OPEN_CLIP, **kwargs)
    if name == "image_reward":
        return ImageReward(paths["image_reward"], tokenizer=paths["bert_tokenizer"], architecture=TINY_BLIP, **kwargs)
    if name == "pickscore":
        return PickScore(paths["clip"], tokenizer=paths["clip"], **kwargs)
    if name == "clip_score":
        return CLIPScore(paths["clip"], **kwargs)
    return AestheticReward(paths["aesthetic"], model=paths["clip"], **kwargs)


ADAPTERS = ["hpsv2", "image_reward", "pickscore", "clip_score", "aesthetic"]


def test_hpsv2_matches_open_clip_forward(checkpoints):
    images = _images()
    scores = torch.tensor(_build("hpsv2", checkpoints)(PROMPTS, images))

    # HPSv2's preprocess_val: longest side to 32 (on the float tensor), centred on black; open_clip pads to 77.
    pixels = reference_pixels(images, 32, "pad", resample="tensor")
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["clip_tokenizer"])
    ids = tokenizer(PROMPTS, padding="max_length", max_length=77, return_tensors="pt")["input_ids"]
    state, arch = checkpoints["hps_state"], TINY_OPEN_CLIP
    expected = (
        _normalize(open_clip_image_features(state, arch, pixels))
        * _normalize(open_clip_text_features(state, arch, ids))
    ).sum(-1)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert scores.std() > 0.01  # distinct images and prompts get distinct scores


def test_hps_padding_geometry():
    # 48×40 → longest side 32: 32×27 (round(26.67)) resized content, 2 zero columns left, 3 right.
    images = torch.ones((1, 3, 48, 40))
    pixels = reference_pixels(images, 32, "pad")
    black = ((0 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)).view(3, 1)
    white = ((1 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)).view(3, 1)
    torch.testing.assert_close(pixels[0, :, :, :2].flatten(1), black.expand(3, 64))
    torch.testing.assert_close(pixels[0, :, :, -3:].flatten(1), black.expand(3, 96))
    torch.testing.assert_close(pixels[0, :, :, 2:-3].flatten(1), white.expand(3, 32 * 27))


def test_image_reward_matches_blip_forward(checkpoints):
    images = _images()
    scores = torch.tensor(_build("image_reward", checkpoints)(PROMPTS, images))

    pixels = reference_pixels(images, 32, "crop")
    tokens = AutoTokenizer.from_pretrained(checkpoints["bert_tokenizer"])(
        PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt"
    )
    raw = image_reward_raw(
        checkpoints["image_reward_state"], TINY_BLIP, pixels, tokens["input_ids"], tokens["attention_mask"]
    )
    torch.testing.assert_close(scores, (raw - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD, atol=1e-5, rtol=0)
    assert scores.std() > 0.01


def test_clip_preprocessing_matches_transformers_processor():
    """PickScore's reference preprocessing is transformers' CLIP processor (the PIL backend)."""
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    images = _images(height=64, width=64)
    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    expected = processor([Image.fromarray(a) for a in to_uint8(images)], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(reference_pixels(images, 32, "crop"), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("height, width", [(512, 512), (1216, 832), (832, 1216), (1100, 640)])
def test_pickscore_sees_what_clip_processor_gives(checkpoints, height, width):
    """PickScore (and CLIP score, the aesthetic score) are published through transformers' CLIPProcessor, which
    floors a centre crop's offset where torchvision rounds it: the pixels the model sees equal the processor's (PIL
    backend) pixel for pixel, at its 224 px and at the tiny model's 32, including aspect ratios where the two
    roundings crop one pixel apart (832×1216 and 1216×832 at 224, 1100×640 at 32)."""
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    images = _images(count=2, height=height, width=width)

    def processed(size):
        processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        return processor([Image.fromarray(a) for a in to_uint8(images)], return_tensors="pt")["pixel_values"]

    assert torch.equal(reference_pixels(images, 224, "crop", offset="floor"), processed(224))
    if (height, width) in ((1216, 832), (832, 1216)):  # torchvision's rounding (ImageReward's) is a pixel away here
        assert not torch.equal(reference_pixels(images, 224, "crop"), processed(224))
    reward = _build("pickscore", checkpoints)
    reward(PROMPTS[:2], images)  # loads the model
    seen, forward = [], reward.model.get_image_features
    reward.model.get_image_features = lambda pixel_values: seen.append(pixel_values) or forward(pixel_values)
    reward(PROMPTS[:2], images)
    assert torch.equal(seen[0], processed(reward.model.config.vision_config.image_size))
    if (height, width) == (1100, 640):
        assert not torch.equal(reference_pixels(images, 32, "crop"), seen[0])


@pytest.mark.parametrize("name", ["pickscore", "clip_score", "aesthetic"])
def test_clip_rewards_match_formula(checkpoints, name):
    images = _images()
    scores = torch.tensor(_build(name, checkpoints)(PROMPTS, images))

    model = CLIPModel.from_pretrained(checkpoints["clip"]).eval()
    with torch.no_grad():
        image = _normalize(model.get_image_features(pixel_values=reference_pixels(images, 32)).pooler_output)
        tokens = AutoTokenizer.from_pretrained(checkpoints["clip"])(PROMPTS, padding=True, return_tensors="pt")
        text = _normalize(model.get_text_features(**tokens).pooler_output)
    cosine = (image * text).sum(-1)
    if name == "pickscore":
        expected = model.logit_scale.exp() * cosine
    elif name == "clip_score":
        expected = 100 * cosine.clamp(min=0)
    else:
        z, head = image, checkpoints["aesthetic_state"]
        for index in (0, 2, 4, 6, 7):
            z = F.linear(z, head[f"layers.{index}.weight"], head[f"layers.{index}.bias"])
        expected = z.squeeze(-1)
    torch.testing.assert_close(scores, expected.detach(), atol=1e-4, rtol=1e-5)
    if name != "clip_score":  # clamped at 0, random tiny CLIP may score every pair negative
        assert scores.std() > 1e-3


@pytest.mark.parametrize("name", ADAPTERS)
def test_batch_size_invariance_and_gradients(checkpoints, name):
    images = _images(seed=5)
    whole = _build(name, checkpoints, batch_size=5)(PROMPTS, images)
    pieces = _build(name, checkpoints, batch_size=2)(PROMPTS, images)
    np.testing.assert_allclose(whole, pieces, atol=1e-5)

    reward = _build(name, checkpoints)
    images = images.clone().requires_grad_(True)
    differentiable = reward.score(PROMPTS, images)
    differentiable.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0 and torch.isfinite(images.grad).all()
    # The tensor path skips 8-bit rounding and uses torch's bicubic: close to the reference path, not equal.
    spread = max(float(np.std(whole)), 1e-3)
    assert (differentiable.detach() - torch.tensor(whole)).abs().max() < 0.5 * spread + 1e-3


@pytest.mark.parametrize("name", ADAPTERS)
def test_rejects_bad_inputs(checkpoints, name):
    reward = _build(name, checkpoints)
    images = _images(count=2)
    with pytest.raises(ValueError, match="shape"):
        reward(PROMPTS[:2], images.permute(0, 2, 3, 1))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        reward(PROMPTS[:2], images * 2)
    with pytest.raises(ValueError, match="prompts for 2 images"):
        reward(PROMPTS[:3], images)
    with pytest.raises(ValueError, match="floating point"):
        reward(PROMPTS[:2], (images * 255).to(torch.uint8))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("hpsv2", "hf download xswu/HPSv2 HPS_v2.1_compressed.pt"),
        ("image_reward", "hf download THUDM/ImageReward ImageReward.pt"),
        ("pickscore", "hf download yuvalkirstain/PickScore_v1"),
        ("aesthetic", "hf download openai/clip-vit-large-patch14"),
    ],
)
def test_missing_checkpoint_says_what_to_download(monkeypatch, tmp_path, name, expected):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once at import otherwise
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    reward = get_reward_function(name)
    with pytest.raises(FileNotFoundError, match=expected) as error:
        reward(["a cat"], torch.rand(1, 3, 32, 32))
    keyword = {"hpsv2": "checkpoint", "image_reward": "checkpoint", "pickscore": "model", "aesthetic": "model"}[name]
    message = str(error.value)
    # The advice names the real keyword, in YAML and in the command line's JSON.
    assert f"reward_kwargs: {{{name}: {{{keyword}: DIR" in message, message
    assert f"""--reward_kwargs '{{"{name}": {{"{keyword}": "DIR""" in message, message


def test_a_local_path_with_a_typo_gets_no_download_advice(tmp_path):
    from trl_dance.rewards.step_aware import StepAwarePreferenceModel

    reward = get_reward_function("hpsv2", checkpoint=str(tmp_path / "HPS_v2.1_compresed.pt"))
    with pytest.raises(FileNotFoundError, match="no such file or directory") as error:
        reward(["a cat"], torch.rand(1, 3, 32, 32))
    assert "hf download" not in str(error.value) and "'checkpoint'" in str(error.value)
    # SPO's step-aware model is set by SPO's own fields, not reward_kwargs.
    with pytest.raises(FileNotFoundError, match="--step_aware_model PATH") as error:
        StepAwarePreferenceModel(checkpoint="./spm.pt").load("cpu")
    assert "reward_kwargs" not in str(error.value)


def test_registry_passes_constructor_arguments(checkpoints):
    reward = get_reward_function(
        "hpsv2", checkpoint=checkpoints["hps"], architecture=TINY_OPEN_CLIP, tokenizer=checkpoints["clip_tokenizer"]
    )
    assert isinstance(reward, HPSv2Reward) and reward.__name__ == "hpsv2"
    with pytest.raises(ValueError, match="takes no arguments"):
        get_reward_function("brightness", checkpoint="x")


def test_open_clip_parity(checkpoints):
    """The tiny checkpoint loads into open_clip itself (installed with the dev extra) and gives the features the
    reference forward gives, and the HPSv2 adapter's scores are open_clip's: its CLIP forward's normalised features,
    the diagonal of image @ text, as hpsv2's img_score computes them."""

    model = open_clip_model(TINY_OPEN_CLIP)
    model.load_state_dict(checkpoints["hps_state"])
    pixels = reference_pixels(_images(), 32, "pad", resample="tensor")
    expected = open_clip_image_features(checkpoints["hps_state"], TINY_OPEN_CLIP, pixels)
    torch.testing.assert_close(model.encode_image(pixels), expected, atol=1e-5, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["clip_tokenizer"])
    ids = tokenizer(PROMPTS, padding="max_length", max_length=77, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        image_features, text_features, _ = model.eval()(pixels, ids)  # open_clip's forward: L2-normalised features
    scores = torch.tensor(_build("hpsv2", checkpoints)(PROMPTS, _images()))
    torch.testing.assert_close(scores, torch.diagonal(image_features @ text_features.T), atol=1e-5, rtol=0)


def test_hpsv2_scores_equal_the_hpsv2_package(tmp_path, monkeypatch):
    """The ``hpsv2`` package's own ``img_score.score`` (installed by the dev set-up, see scripts/setup_env.sh) on a
    tiny random checkpoint in its format, its own model class, transforms and open_clip tokenizer, PIL images of the
    same pixels: the adapter's scores equal it to 1e-5. Prompts with "!" pin the tokenizer (transformers would cut
    laion's pad token out of them) and a non-square image the package's float-tensor resize."""
    monkeypatch.setenv("HPS_ROOT", str(tmp_path / "hps-root"))
    from hpsv2 import img_score
    from PIL import Image

    state = open_clip_state_dict(TINY_HPS, seed=5)
    checkpoint = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": state}, checkpoint)
    model, preprocess_val = hpsv2_package_model(TINY_HPS, str(tmp_path))
    monkeypatch.setattr(img_score, "model_dict", {"model": model, "preprocess_val": preprocess_val})
    prompts = ["a cat", "blue sky, Sunset!", "an old car, parked", "wow!! <|endoftext|>", "sunset"]
    images = _images(height=48, width=40)
    package = [
        float(img_score.score(Image.fromarray(array), prompt, cp=str(checkpoint))[0])
        for array, prompt in zip(to_uint8(images), prompts)
    ]
    tokenizer = save_open_clip_bpe_tokenizer(str(tmp_path / "tokenizer"))
    scores = HPSv2Reward(str(checkpoint), tokenizer=tokenizer, architecture=TINY_HPS)(prompts, images)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(package), atol=1e-5, rtol=0)
    assert torch.tensor(package).std() > 0.01


def test_image_reward_scores_equal_the_image_reward_package(tmp_path, monkeypatch):
    """The image-reward package's own ``ImageReward.load(...).score(prompt, pil_image)`` (its BLIP, transforms and
    tokenizer class; see reference_packages.py for the sizes and transformers 4 helpers set there) on a tiny random
    ``ImageReward.pt``: the adapter's scores equal it to 1e-5, and every checkpoint tensor is one the package loads."""
    from PIL import Image

    state = image_reward_state_dict(TINY_IMAGE_REWARD, seed=6)
    checkpoint = str(tmp_path / "ImageReward.pt")
    torch.save(state, checkpoint)
    tokenizer = save_bert_tokenizer(str(tmp_path / "bert"))
    model = load_image_reward_package(monkeypatch, TINY_IMAGE_REWARD, checkpoint, tokenizer, str(tmp_path))
    loaded = model.load_state_dict(state, strict=False)  # (the package loads non-strictly: check what it took)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"blip.text_proj.weight", "blip.text_proj.bias"}
    images = _images(height=48, width=40)
    with torch.no_grad():
        package = [model.score(prompt, Image.fromarray(array)) for prompt, array in zip(PROMPTS, to_uint8(images))]
    scores = ImageReward(checkpoint, tokenizer=tokenizer, architecture=TINY_IMAGE_REWARD)(PROMPTS, images)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(package), atol=1e-5, rtol=0)
    assert torch.tensor(package).std() > 0.01


def test_clip_score_equals_open_clip(tmp_path):
    """The CLIP score of a tiny random OpenAI-architecture CLIP (quick GELU) as open_clip computes it (its model,
    its OpenAI preprocessing of the PIL image, its tokenizer): the adapter, on the same weights in transformers'
    layout, gives 100 · max(cos, 0) of open_clip's features to 1e-5 (and their cosine before the clamp)."""
    import open_clip
    from PIL import Image

    from trl_dance.rewards.hps import clip_config, open_clip_to_transformers

    quick = {"hidden_act": "quick_gelu"}
    arch = {
        **TINY_HPS,
        "vision_config": {**TINY_HPS["vision_config"], **quick},
        "text_config": {**TINY_HPS["text_config"], **quick},
    }
    state = open_clip_state_dict(arch, seed=7)
    model = open_clip_model(arch, quick_gelu=True)
    model.load_state_dict(state)
    size = arch["vision_config"]["image_size"]
    preprocess = open_clip.image_transform(size, is_train=False)  # OpenAI's: resize, centre crop
    prompts = ["a cat", "blue sky, Sunset!", "an old car, parked", "a red house by the sea", "sunset"]
    images = _images(height=48, width=40)
    pixels = torch.stack([preprocess(Image.fromarray(array)) for array in to_uint8(images)])
    with torch.no_grad():
        image_features, text_features, _ = model.eval()(pixels, open_clip.tokenize(prompts))
    cosine = (image_features * text_features).sum(-1)
    directory = str(tmp_path / "clip")
    hf = CLIPModel(clip_config(arch))
    hf.load_state_dict(open_clip_to_transformers(state))
    hf.save_pretrained(directory)
    save_open_clip_bpe_tokenizer(directory, pad_token="<|endoftext|>")
    reward = CLIPScore(directory)
    scores = torch.tensor(reward(prompts, images))
    torch.testing.assert_close(scores, 100 * cosine.clamp(min=0), atol=1e-5, rtol=0)
    torch.testing.assert_close(reward.cosine(prompts, images, exact=True), cosine, atol=1e-6, rtol=0)  # unclamped
    assert cosine.std() > 0.01


def test_grpo_trains_against_model_rewards_from_names(tiny_model_dir, checkpoints, tmp_path):
    """The acceptance case: reward_funcs=["hpsv2", "pickscore"] by name, checkpoint paths in reward_kwargs; the
    rollout rewards are the adapters' scores of the rollout images, weighted and summed."""
    from conftest import PROMPTS as TRAIN_PROMPTS
    from conftest import tiny_grpo_config
    from datasets import Dataset
    from peft import LoraConfig

    from trl_dance import DanceGRPOTrainer

    reward_kwargs = {
        "hpsv2": {
            "checkpoint": checkpoints["hps"],
            "tokenizer": checkpoints["clip_tokenizer"],
            "architecture": TINY_OPEN_CLIP,
        },
        "pickscore": {"model": checkpoints["clip"], "tokenizer": checkpoints["clip"]},
    }
    rewards = {}
    for threaded in (True, False):
        args = tiny_grpo_config(
            tmp_path,
            max_steps=1,
            gradient_accumulation_steps=5,
            reward_kwargs=reward_kwargs,
            reward_weights=[1.0, 0.01],
            rollout_batch_size=3,
            reward_worker_thread=threaded,
        )
        trainer = DanceGRPOTrainer(
            tiny_model_dir("flux"),
            ["hpsv2", "pickscore"],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": TRAIN_PROMPTS}),
            peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]),
        )
        trainer.train()
        rollout = trainer._rollout
        rewards[threaded] = rollout["rewards"]
    hps, pick = (_build(name, checkpoints) for name in ("hpsv2", "pickscore"))
    expected = torch.tensor(hps(rollout["prompts"], rollout["images"])) + 0.01 * torch.tensor(
        pick(rollout["prompts"], rollout["images"])
    )
    torch.testing.assert_close(rollout["rewards"], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(rewards[True], rewards[False], atol=0, rtol=0)
    logged = trainer.state.log_history[0]
    assert "rewards/hpsv2/mean" in logged and "rewards/pickscore/mean" in logged


def test_reward_kwargs_must_name_a_configured_reward(tiny_model_dir, tmp_path):
    from conftest import tiny_grpo_config

    from trl_dance import DanceGRPOTrainer

    args = tiny_grpo_config(tmp_path, reward_kwargs={"hpsv2": {"checkpoint": "x"}})
    with pytest.raises(ValueError, match=r"not in reward_funcs: \['hpsv2'\]"):
        DanceGRPOTrainer(tiny_model_dir("flux"), ["brightness"], args=args)


def test_reward_kwargs_parse_from_yaml_and_command_line(tmp_path):
    from trl import TrlParser

    from trl_dance import DanceGRPOConfig

    config = tmp_path / "config.yaml"
    config.write_text(
        "output_dir: out\nuse_cpu: true\nreward_kwargs:\n  hpsv2: {checkpoint: /ckpt/hps.pt, dtype: bfloat16}\n"
    )
    (args,) = TrlParser((DanceGRPOConfig,)).parse_args_and_config(["--config", str(config)])
    assert args.reward_kwargs == {"hpsv2": {"checkpoint": "/ckpt/hps.pt", "dtype": "bfloat16"}}
    cli = ["--output_dir", "out", "--use_cpu", "true", "--reward_kwargs", '{"pickscore": {"model": "/ckpt/pick"}}']
    (args,) = TrlParser((DanceGRPOConfig,)).parse_args_and_config(cli)
    assert args.reward_kwargs == {"pickscore": {"model": "/ckpt/pick"}}


@pytest.mark.parametrize("name", ADAPTERS)
def test_score_gradient_matches_finite_differences(checkpoints, name):
    """The differentiable path (reward backpropagation): the directional derivative of Σ score along a random
    direction equals central finite differences, all in float64 (measured relative error at most 3.2e-8, ImageReward)."""
    reward = _build(name, checkpoints, dtype=torch.float64)
    images = (_images(count=3, seed=7).double() * 0.8 + 0.1).requires_grad_(True)  # away from the [0, 1] clamp
    direction = torch.randn(images.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    reward.score(PROMPTS[:3], images).sum().backward()
    analytic = (images.grad * direction).sum().item()
    eps = 1e-5
    with torch.no_grad():
        plus = reward.score(PROMPTS[:3], images + eps * direction).sum().item()
        minus = reward.score(PROMPTS[:3], images - eps * direction).sum().item()
    numeric = (plus - minus) / (2 * eps)
    assert abs(analytic) > 1e-8 or name == "clip_score"  # clip_score is clamped at 0: its gradient may vanish
    assert abs(analytic - numeric) <= 1e-6 * max(abs(numeric), 1e-2)
