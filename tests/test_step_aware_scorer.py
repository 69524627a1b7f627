"""SPO's step-aware preference model: the published checkpoint layout, the plain CLIP at identity modulation, the
timestep's effect, and SPOTrainer with it as the step scorer."""

import pytest
import torch
from conftest import PROMPTS
from reward_checkpoints import save_tiny_clip, save_tiny_step_aware_model
from transformers import CLIPModel, CLIPTokenizer

from trl_dance.rewards.image_transforms import CLIP_MEAN, CLIP_STD
from trl_dance.rewards.step_aware import StepAwarePreferenceModel


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(str(tmp_path_factory.mktemp("clip")), seed=3)


def _scorer(clip_dir, tmp_path, identity=False, seed=0):
    path = save_tiny_step_aware_model(str(tmp_path / f"spm_{identity}_{seed}.bin"), clip_dir, identity, seed)
    return StepAwarePreferenceModel(path, model=clip_dir, tokenizer=clip_dir)


def _images(count=4, height=40, width=48):
    return torch.rand(count, 3, height, width, generator=torch.Generator().manual_seed(1))


def test_identity_modulation_is_the_plain_clip_score(clip_dir, tmp_path):
    """With every modulation at (shift, scale, gate) = (0, 0, 1) the score is PickScore's formula on the plain CLIP
    (SPO's preprocessing: bicubic shorter side to 32, centre crop, CLIP normalisation; prompts padded to 77), at any
    timestep."""
    scorer = _scorer(clip_dir, tmp_path, identity=True)
    images, prompts = _images(), PROMPTS[:4]
    clip, tokenizer = CLIPModel.from_pretrained(clip_dir).eval(), CLIPTokenizer.from_pretrained(clip_dir)
    resized = torch.nn.functional.interpolate(images, size=(32, 38), mode="bicubic", align_corners=False)
    pixels = resized[..., :, 3:35].clamp(0, 1)
    pixels = (pixels - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        image = clip.get_image_features(pixel_values=pixels).pooler_output
        ids = tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        text = clip.get_text_features(input_ids=ids).pooler_output
    image, text = image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)
    expected = clip.logit_scale.exp() * (image * text).sum(-1)
    for t in (0, 500, 999):
        got = scorer(prompts, images, torch.full((4,), t))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_timestep_conditions_the_score_and_the_layout_is_strict(clip_dir, tmp_path):
    scorer = _scorer(clip_dir, tmp_path, seed=5)
    images, prompts = _images(), PROMPTS[:4]
    early, late = scorer(prompts, images, torch.full((4,), 900)), scorer(prompts, images, torch.zeros(4))
    assert (early - late).abs().max() > 1e-3
    # Each row scored alone equals the batch (per-sample timesteps, no mixing).
    single = torch.cat(
        [scorer(prompts[i : i + 1], images[i : i + 1], torch.tensor([900 - 300 * i])) for i in range(3)]
    )
    batch = scorer(prompts[:3], images[:3], torch.tensor([900, 600, 300]))
    torch.testing.assert_close(single, batch, atol=1e-5, rtol=1e-5)
    # A checkpoint without its timestep embedding is refused by name.
    path = tmp_path / "broken.bin"
    state = torch.load(_scorer(clip_dir, tmp_path).checkpoint)
    torch.save({k: v for k, v in state.items() if "t_embedder" not in k}, path)
    with pytest.raises(RuntimeError, match="t_embedder.mlp.0.weight"):
        StepAwarePreferenceModel(str(path), model=clip_dir, tokenizer=clip_dir)(prompts, images, torch.zeros(4))


def test_spo_trainer_scores_pools_with_it(tiny_model_dir, clip_dir, tmp_path):
    """SPOTrainer(step_aware_model=...) scores candidates with the model at the SD timestep of each x̂0."""
    from datasets import Dataset
    from peft import LoraConfig
    from test_spo import CHAINS, spo_config

    from trl_dance import SPOTrainer

    path = save_tiny_step_aware_model(str(tmp_path / "spm.bin"), clip_dir, seed=2)
    args = spo_config(
        tmp_path,
        step_aware_model=path,
        step_aware_model_kwargs={"model": clip_dir, "tokenizer": clip_dir},
        score_scale=1.0,
    )
    trainer = SPOTrainer(
        tiny_model_dir("sd"),
        "brightness",
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
        peft_config=LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
    )
    assert isinstance(trainer.step_scorer, StepAwarePreferenceModel)
    seen = []
    original = trainer.step_scorer._score
    trainer.step_scorer._score = lambda p, images, t: seen.append(images.clone()) or original(p, images, t)
    trainer._prepare_inputs(CHAINS)
    assert trainer._rollout["score_gap"].shape == (2, 4) and (trainer._rollout["score_gap"] > 0).all()
    # SPO resizes the decoded x̂0 before it clamps: the model gets them unclamped (the random VAE overshoots [0, 1]).
    pixels = torch.cat(seen)
    assert pixels.min() < 0 or pixels.max() > 1
    policy = trainer.policy
    latents = policy.initial_noise([torch.Generator().manual_seed(0)])
    with torch.no_grad(), policy.unclamped_decode():
        raw = policy.decode(latents)
    with torch.no_grad():
        torch.testing.assert_close(policy.decode(latents), raw.clamp(0, 1))  # decode itself is unchanged
