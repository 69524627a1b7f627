import io
import math
import os
import re

import pytest
import torch
from conftest import LEARNING_SEED, LORA_TARGETS, PROMPTS, assert_learned, tiny_dpo_config
from datasets import Dataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from PIL import Image

from trl_dance import DiffusionDPOTrainer
from trl_dance.losses import dpo_losses
from trl_dance.preference_data import INDEX_KEY, PreferenceCollator, load_image
from trl_dance.testing import TINY_VIDEO_FRAMES, tiny_preference_dataset

_config = tiny_dpo_config


def _lora():
    return LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS)


def _synthetic_pairs(kind, count=32):
    return tiny_preference_dataset(kind, count)


def test_loss_matches_hand_computation():
    pw, pl = torch.tensor([0.10, 0.30]), torch.tensor([0.20, 0.10])
    rw, rl = torch.tensor([0.15, 0.20]), torch.tensor([0.15, 0.20])
    beta = 10.0
    z = -beta / 2 * ((pw - pl) - (rw - rl))  # [0.5, -1.0]
    torch.testing.assert_close(z, torch.tensor([0.5, -1.0]))

    def loss(kinds, **kwargs):
        losses, chosen, rejected = dpo_losses(pw, pl, rw, rl, beta, kinds, **kwargs)
        torch.testing.assert_close(chosen - rejected, z)  # TRL's rewards/margins is z
        return losses.mean().item()

    softplus = lambda x: math.log1p(math.exp(x))  # noqa: E731  −log σ(−x)
    expected = (softplus(-0.5) + softplus(1.0)) / 2
    assert loss(["sigmoid"]) == pytest.approx(expected, rel=1e-6)
    assert loss(["hinge"]) == pytest.approx((0.5 + 2.0) / 2)
    ipo = ((0.5 / beta - 1 / (2 * beta)) ** 2 + (-1.0 / beta - 1 / (2 * beta)) ** 2) / 2
    assert loss(["ipo"]) == pytest.approx(ipo, rel=1e-6)
    # robust with ε: ((1 − ε)·(−log σ(z)) − ε·(−log σ(−z))) / (1 − 2ε); ε = 0 is sigmoid.
    eps = 0.1
    robust = [((1 - eps) * softplus(-v) - eps * softplus(v)) / (1 - 2 * eps) for v in (0.5, -1.0)]
    assert loss(["robust"], label_smoothing=eps) == pytest.approx(sum(robust) / 2, rel=1e-6)
    assert loss(["robust"]) == pytest.approx(expected, rel=1e-6)
    # sft is the chosen image's denoising error; types add up with their weights.
    assert loss(["sft"]) == pytest.approx(0.2, rel=1e-6)
    assert loss(["sigmoid", "sft"], loss_weights=[1.0, 0.5]) == pytest.approx(expected + 0.1, rel=1e-6)
    # exo_pair is a KL divergence: >= 0, and 0 where softmax(z) = (1 − ε, ε).
    target = math.log((1 - 1e-3) / 1e-3)
    at = dpo_losses(  # policy error −2·target/β on the chosen image: z = target
        torch.tensor([-2 * target / beta]),
        torch.zeros(1),
        torch.zeros(1),
        torch.zeros(1),
        beta,
        ["exo_pair"],
        label_smoothing=1e-3,
    )
    assert at[0].item() == pytest.approx(0.0, abs=1e-6) and loss(["exo_pair"], label_smoothing=1e-3) > 0
    # A tie (weight ½) is scored in both orders.
    tie = dpo_losses(pw[:1], pl[:1], rw[:1], rl[:1], beta, weights=torch.tensor([0.5]))[0].item()
    assert tie == pytest.approx(0.5 * softplus(-0.5) + 0.5 * softplus(0.5), rel=1e-6)


def test_loss_types_are_checked(tmp_path):
    with pytest.raises(ValueError, match="loss_type must be a list of"):
        _config(tmp_path, loss_type=["sigmoid", "kto"])
    with pytest.raises(ValueError, match="one weight per loss_type"):
        _config(tmp_path, loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValueError, match=r"robust loss needs label_smoothing in \[0, 0.5\)"):
        _config(tmp_path, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="exo_pair loss needs label_smoothing"):
        _config(tmp_path, loss_type="exo_pair")
    assert _config(tmp_path, loss_type="hinge").loss_type == ["hinge"]  # a string, as TRL accepts


@pytest.mark.parametrize("kind", ["sd", "sdxl", "sd3", "flux", "wan", "qwen-image21"])
def test_loss_is_ln2_at_lora_initialisation(tiny_model_dir, tmp_path, kind):
    """With the LoRA at its initialisation the policy is the reference: z = 0, loss ln 2, implicit accuracy ½ (Wan:
    video pairs, (B, 2, F, 3, H, W) pixels; Qwen-Image 2.1: RGB pairs its RGBA VAE encodes)."""
    data = _synthetic_pairs(kind, count=4)
    video = {"num_frames": TINY_VIDEO_FRAMES} if kind == "wan" else {}
    text = {"max_sequence_length": 64} if kind == "qwen-image21" else {}  # its template's tokens
    trainer = DiffusionDPOTrainer(
        tiny_model_dir(kind), args=_config(tmp_path, **video, **text), train_dataset=data, peft_config=_lora()
    )
    batch = trainer._prepare_inputs(trainer.data_collator([data[i] for i in range(4)]))
    assert batch["pixel_values"].shape[1:3] == ((2, TINY_VIDEO_FRAMES) if video else (2, 3))
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert trainer._metrics["implicit_acc"] == [0.5] and trainer._metrics["margin"] == [0.0]
    assert trainer._metrics["mse/chosen/policy"] == trainer._metrics["mse/chosen/ref"]


def _held_out(trainer, data, draws=16):
    """Mean implicit accuracy on ``data`` over ``draws`` timestep/noise draws (no update)."""
    batch = trainer._prepare_inputs(trainer.data_collator([data[i] for i in range(len(data))]))
    trainer._metrics.clear()
    with torch.no_grad():
        for _ in range(draws):
            trainer.compute_loss(trainer.model, batch)
    return sum(trainer._metrics["implicit_acc"]) / draws


def _preferred_projection(trainer, data, kind, denoiser):
    """Mean projection of generated latents on the preferred direction: mean encoded (chosen − rejected).

    Measured in the model's latent space because a random VAE's encoder is not its decoder's inverse.
    """
    batch = trainer._prepare_inputs(trainer.data_collator([data[i] for i in range(len(data))]))
    latents = trainer.policy.encode_images(batch["pixel_values"].flatten(0, 1), torch.Generator().manual_seed(0))
    direction = (latents[0::2] - latents[1::2]).mean(0).flatten()
    direction = direction / direction.norm()
    pipeline = DiffusionPipeline.from_pretrained(trainer.policy.pipeline.config._name_or_path)
    setattr(pipeline, trainer.policy.denoiser_name, denoiser)
    video = {"num_frames": TINY_VIDEO_FRAMES, "max_sequence_length": 32} if kind == "wan" else {}
    with torch.no_grad():
        output = pipeline(
            PROMPTS * 2,
            num_inference_steps=6,
            height=32,
            width=32,
            output_type="latent",
            guidance_scale=1.0,
            generator=torch.Generator().manual_seed(5),
            **video,
        )
    generated = output.frames if kind == "wan" else output.images
    return (generated.reshape(generated.shape[0], -1) @ direction).mean().item()


def _denoiser_of_the_pairs(model_dir, data, folder) -> str:
    """A copy of the tiny pipeline whose denoiser was trained (150 SFT steps, full fine-tune) to denoise the pairs'
    images, saved to ``folder``: like a real checkpoint, its prediction then depends on the image in a data-aware way."""
    args = _config(folder, loss_type=["sft"], max_steps=150, learning_rate=1e-3, seed=LEARNING_SEED, logging_steps=50)
    trainer = DiffusionDPOTrainer(model_dir, args=args, train_dataset=data)
    trainer.train()
    trainer.policy.pipeline.save_pretrained(str(folder / "pipeline"))
    return str(folder / "pipeline")


# Colour preference: each pair is one sample shifted toward red (chosen) and toward cyan (rejected). Measured (lr 1e-2,
# 24 training pairs, 8 held out x 16 timestep/noise draws = 128 evaluations, standard error 0.044): sd3 (velocity
# target, beta 500, 60 steps) accuracy 0.984, projection 1.01 -> 10.75. sd (eps target, beta 1000, 120 steps): on the
# random UNet accuracy 0.516 and the projection moves away, -2.60 -> -3.91; after 150 SFT steps on the images, 0.758,
# -0.59 -> 3.69. Why: with an eps target, chosen and rejected share their target (the noise), so the preference reaches
# the model only through how its prediction depends on the image, which is arbitrary in a random UNet (the velocity
# target eps - x0 itself differs by the images' difference); an artefact of the tiny model, not of the loss.
# wan (5-frame videos, velocity target, beta 500, 60 steps) over seeds 42, 1, 2 x 1 and 2 threads: accuracy 0.977-1.0,
# projection gain 6.2-12.4 (margins 0.25 and 3.0: the smallest gains / 1.9 and / 2.1).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "steps", "beta", "min_accuracy", "min_shift"),
    [("sd", 120, 1000.0, 0.6, 1.5), ("sd3", 60, 500.0, 0.75, 3.0), ("wan", 60, 500.0, 0.75, 3.0)],
)
def test_dpo_learns_the_preference(tiny_model_dir, tmp_path, kind, steps, beta, min_accuracy, min_shift):
    data = tiny_preference_dataset(kind, count=32, color=(1, -1, -1))
    video = {"num_frames": TINY_VIDEO_FRAMES} if kind == "wan" else {}
    train, held_out = data.select(range(24)), data.select(range(24, 32))
    model_dir = tiny_model_dir(kind)
    if kind == "sd":
        model_dir = _denoiser_of_the_pairs(model_dir, data, tmp_path / "sft")
    trainer = DiffusionDPOTrainer(
        model_dir,
        args=_config(tmp_path, max_steps=steps, beta=beta, seed=LEARNING_SEED, **video),
        train_dataset=train,
        peft_config=_lora(),
    )
    base = DiffusionPipeline.from_pretrained(model_dir)
    before = _preferred_projection(trainer, train, kind, getattr(base, trainer.policy.denoiser_name))
    assert _held_out(trainer, held_out) == 0.5
    trainer.train()
    accuracy = _held_out(trainer, held_out)
    after = _preferred_projection(trainer, train, kind, trainer.model)
    # Accuracy over 128 evaluations: its standard error at 0.5 is 0.044.
    assert_learned("held_out_implicit_accuracy", 0.5, accuracy, 0.044, min_accuracy - 0.5)
    assert_learned("preferred_projection", before, after, 0.0, min_shift)
    logged = trainer.state.log_history[0]
    for key in (
        "loss",
        "implicit_acc",
        "margin",
        "mse/chosen/policy",
        "mse/rejected/policy",
        "mse/chosen/ref",
        "mse/rejected/ref",
    ):
        assert key in logged, key


def _png(color):
    buffer = io.BytesIO()
    Image.new("RGB", (40, 48), color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_pickapic_rows_ties_and_missing_images(tiny_model_dir, tmp_path):
    rows = {
        "caption": ["red", "green", "tie", "blue"],
        "jpg_0": [_png((255, 0, 0)), _png((0, 0, 0)), _png((9, 9, 9)), None],
        "jpg_1": [_png((0, 0, 0)), _png((0, 255, 0)), _png((9, 9, 9)), _png((0, 0, 255))],
        "label_0": [1.0, 0.0, 0.5, 1.0],
    }
    data = Dataset.from_dict(rows)
    trainer = DiffusionDPOTrainer(
        tiny_model_dir("sd"),
        args=_config(tmp_path, per_device_train_batch_size=4),
        train_dataset=data,
        peft_config=_lora(),
    )
    assert trainer.num_ties_dropped == 1 and len(trainer.train_dataset) == 3
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    assert batch["num_missing"] == 1 and batch["prompts"] == ["red", "green"]
    assert batch["missing"] == ["a row: the chosen image (none given: no path or bytes)"]  # (loaders add the row)
    row = {"caption": "x", "jpg_0": "no/such.png", "jpg_1": _png((0, 0, 0)), "label_0": 1.0}
    named = trainer.data_collator([row, trainer.train_dataset[0]])["missing"]
    assert named == [
        "a row: the chosen image 'no/such.png' (no such file; relative paths resolve from " + repr(os.getcwd()) + ")"
    ]
    chosen = batch["pixel_values"][:, 0]
    assert chosen[0, 0].mean() == pytest.approx(1.0) and chosen[1, 1].mean() == pytest.approx(1.0)  # red, green won
    assert batch["time_ids"][0].tolist() == [48, 40, 3, 0, 32, 32]  # original H, W; 38x32 after resize: crop top 3
    trainer.train()
    assert trainer.state.log_history[0]["data/ties_dropped"] == 1

    kept = DiffusionDPOTrainer(
        tiny_model_dir("sd"), args=_config(tmp_path, ties="keep"), train_dataset=data, peft_config=_lora()
    )
    batch = kept.data_collator([kept.train_dataset[i] for i in range(4)])
    assert batch["weights"].tolist() == [1.0, 1.0, 0.5]


def test_streaming_pickapic_dataset_trains_and_drops_ties_as_it_streams(tiny_model_dir, tmp_path):
    """Pick-a-Pic's size (850k pairs) calls for streaming: an IterableDataset (here without declared features) is
    accepted, its ties are filtered lazily, and training runs for max_steps."""
    rows = {
        "caption": ["red", "tie", "green", "blue"] * 4,
        "jpg_0": [_png((255, 0, 0)), _png((9, 9, 9)), _png((0, 0, 0)), _png((0, 0, 255))] * 4,
        "jpg_1": [_png((0, 0, 0)), _png((9, 9, 9)), _png((0, 255, 0)), _png((0, 0, 0))] * 4,
        "label_0": [1.0, 0.5, 0.0, 1.0] * 4,
    }
    stream = Dataset.from_dict(rows).to_iterable_dataset().map(lambda row: row)  # .map forgets the features
    assert stream.column_names is None
    args = _config(tmp_path, per_device_train_batch_size=4, max_steps=2, logging_steps=1)
    trainer = DiffusionDPOTrainer(tiny_model_dir("sd"), args=args, train_dataset=stream, peft_config=_lora())
    assert trainer.data_format == "pickapic" and trainer.num_ties_dropped is None
    assert [row["caption"] for row in trainer.train_dataset][:3] == ["red", "green", "blue"]
    trainer.train()
    assert trainer.state.global_step == 2 and all(math.isfinite(h["loss"]) for h in trainer.state.log_history[:2])
    with pytest.raises(ValueError, match="set max_steps > 0"):
        DiffusionDPOTrainer(tiny_model_dir("sd"), args=_config(tmp_path, max_steps=-1), train_dataset=stream)


@pytest.mark.parametrize("resume_at", [3, 4])
def test_resume_reproduces_the_uninterrupted_run_across_epochs(tiny_model_dir, tmp_path, resume_at):
    """8 pairs, 4 per step: 2 steps per epoch, 6 steps. Interrupted in the middle of epoch 2 (after step 3) or at its
    end (after step 4) and resumed: the LoRA is bit-identical to the uninterrupted run's, random crops, flips, caption
    dropout, timesteps and noise included."""
    data = _synthetic_pairs("sd", count=8)

    def run(output_dir, max_steps, resume=None):
        args = _config(
            output_dir,
            resolution=16,
            random_crop=True,
            proportion_empty_prompts=0.3,
            per_device_train_batch_size=4,
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=resume_at,
            beta=1000.0,
        )
        trainer = DiffusionDPOTrainer(tiny_model_dir("sd"), args=args, train_dataset=data, peft_config=_lora())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full", 6)
    run(tmp_path / "first", resume_at)
    resumed = run(tmp_path / "first", 6, resume=str(tmp_path / "first" / "out" / f"checkpoint-{resume_at}"))
    assert resumed.state.global_step == 6 and full.state.epoch == 3
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        if a.requires_grad:
            assert torch.equal(a, b), name


def test_bad_preference_data_is_named(tiny_model_dir, tmp_path, caplog):
    """Labels other than 0, ½, 1, an all-ties dataset, and missing or undecodable (truncated) images beyond
    max_missing_images each stop with a message; below it such rows are skipped, counted and named once (row, file,
    cause): a truncated PNG once stopped a run at its second step with nothing saved."""

    def trainer(rows, **overrides):
        args = _config(tmp_path, per_device_train_batch_size=2, **overrides)
        return DiffusionDPOTrainer(
            tiny_model_dir("sd"), args=args, train_dataset=Dataset.from_dict(rows), peft_config=_lora()
        )

    red, blue = _png((255, 0, 0)), _png((0, 0, 255))
    rows = {"caption": ["a", "b"], "jpg_0": [red, red], "jpg_1": [blue, blue], "label_0": [1.0, 2.0]}
    with pytest.raises(ValueError, match=r"label_0 of row 1 is 2.0; Pick-a-Pic labels are 1 \(jpg_0 wins\), 0 or 0.5"):
        trainer(rows)
    with pytest.raises(ValueError, match="train_dataset has no preference pairs \\(2 ties were dropped; ties='keep'"):
        trainer(rows | {"label_0": [0.5, 0.5]})

    truncated = red[: len(red) // 2]
    broken = trainer(rows | {"jpg_1": [blue, truncated], "label_0": [1.0, 1.0]}, max_steps=2)
    broken.train()  # row 1 skipped, the run goes on
    assert broken.state.global_step == 2 and broken._missing_images >= 1
    warned = [r.message for r in caplog.records if "missing or cannot be decoded" in r.message]
    assert re.search(r"row 1 \(prompt 'b'\): cannot decode the image \d+ bytes", warned[0])
    caplog.clear()

    missing = trainer(rows | {"jpg_1": [None, blue], "label_0": [1.0, 1.0]}, max_steps=4, max_missing_images=1)
    with pytest.raises(ValueError, match="2 pairs had a missing image, more than max_missing_images \\(1\\)"):
        missing.train()
    warned = [r.message for r in caplog.records if "skipped a pair whose image is missing" in r.message]
    assert len(warned) == 1 and "row 0: the rejected image (none given" in warned[0]  # the row, the image, its path


def test_pair_transform_is_joint():
    collator = PreferenceCollator(resolution=16, random_crop=True, random_flip=True, seed=3)
    gradient = Image.fromarray((torch.arange(48 * 40 * 3) % 256).to(torch.uint8).reshape(48, 40, 3).numpy())
    rows = [{"prompt": "p", "chosen": gradient, "rejected": gradient.copy()} for _ in range(8)]
    batch = collator(rows)
    assert batch["pixel_values"].shape == (8, 2, 3, 16, 16)
    assert torch.equal(batch["pixel_values"][:, 0], batch["pixel_values"][:, 1])  # same crop, same flip
    assert len({tuple(t[2:4].tolist()) for t in batch["time_ids"]}) > 1  # crops vary between pairs
    assert load_image(None) is None and load_image({"bytes": None, "path": None}) is None


def test_dataloader_workers_draw_their_own_crops():
    """Each worker holds a copy of the collator: without its own stream, worker 1 would repeat worker 0's crops, and
    every epoch would repeat the last."""
    collator = PreferenceCollator(resolution=16, random_crop=True, random_flip=True, seed=3)
    image = Image.new("RGB", (48, 40))
    rows = [{"prompt": "p", "chosen": image, "rejected": image} for _ in range(16)]
    loader = torch.utils.data.DataLoader(rows, batch_size=8, num_workers=2, collate_fn=collator)

    def crops():  # batch 0 comes from worker 0, batch 1 from worker 1
        return [tuple(map(tuple, batch["time_ids"][:, 2:4].tolist())) for batch in loader]

    epoch_1, epoch_2 = crops(), crops()
    assert epoch_1[0] != epoch_1[1] and epoch_2[0] != epoch_2[1]
    assert epoch_1 != epoch_2


def test_bad_inputs_fail_at_construction(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="needs the columns"):
        DiffusionDPOTrainer(
            tiny_model_dir("sd"),
            args=_config(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": ["a"], "image": ["x"]}),
        )
    with pytest.raises(ValueError, match="loss_type"):
        _config(tmp_path, loss_type="kto")
    with pytest.raises(ValueError, match="ties"):
        _config(tmp_path, ties="half")


def test_sft_mode_and_lora_export(tiny_model_dir, tmp_path):
    data = _synthetic_pairs("sd", count=8)
    trainer = DiffusionDPOTrainer(
        tiny_model_dir("sd"), args=_config(tmp_path, loss_type=["sft"]), train_dataset=data, peft_config=_lora()
    )
    trainer.train()
    assert "implicit_acc" not in trainer.state.log_history[0] and "mse/chosen/policy" in trainer.state.log_history[0]
    trainer.save_model(str(tmp_path / "lora"))
    trainer.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "diffusion-dpo" in card and "sft loss" in card and "arXiv:2311.12908" in card
    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dir("sd"))
    pipeline.load_lora_weights(str(tmp_path / "lora"))
    latents, t = torch.randn(2, 4, 16, 16), torch.tensor([10, 500]) / 999  # (the training timesteps 10 and 500)
    cond = trainer.policy.encode_prompts(["a cat", "a dog"])
    with torch.no_grad():
        expected = trainer.policy.predict(trainer.model, latents, cond, at=t)
        got = trainer.policy.predict(pipeline.unet, latents, cond, at=t)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _gif(path, frames):
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return str(path)


def test_video_pairs_are_transformed_jointly_and_bad_videos_named(tmp_path):
    """Every frame of both videos gets one crop and flip; a GIF file reads as its frames; a pair whose videos differ
    in length, or are shorter than num_frames, is refused naming the row."""
    gradient = Image.fromarray((torch.arange(48 * 40 * 3) % 256).to(torch.uint8).reshape(48, 40, 3).numpy())
    frames = [gradient.rotate(10 * i) for i in range(6)]
    collator = PreferenceCollator(resolution=16, random_crop=True, random_flip=True, seed=3, num_frames=5)
    batch = collator([{"prompt": "p", "chosen": frames, "rejected": [f.copy() for f in frames]} for _ in range(8)])
    pixels = batch["pixel_values"]
    assert pixels.shape == (8, 2, 5, 3, 16, 16)
    assert torch.equal(pixels[:, 0], pixels[:, 1])  # the same box and flip for both videos
    assert len({tuple(t[2:4].tolist()) for t in batch["time_ids"]}) > 1  # boxes vary between pairs
    # Within a video, one box for all frames: frame i is the same crop of rotated frame i as a single-image crop.
    single = PreferenceCollator(resolution=16, random_crop=True, random_flip=True, seed=3)
    index_rows = [{"prompt": "p", "chosen": frames, "rejected": frames, INDEX_KEY: 0}]
    video = collator(index_rows)["pixel_values"][0, 0]
    for i in range(5):
        image = single([{"prompt": "p", "chosen": frames[i], "rejected": frames[i], INDEX_KEY: 0}])["pixel_values"]
        torch.testing.assert_close(video[i], image[0, 0])

    gif = _gif(tmp_path / "clip.gif", frames)
    from_file = collator([{"prompt": "p", "chosen": gif, "rejected": frames, INDEX_KEY: 0}])["pixel_values"]
    from_frames = collator(index_rows)["pixel_values"]
    assert (from_file - from_frames).abs().max() < 2 / 127.5  # GIF's palette quantisation, nothing else
    with pytest.raises(ValueError, match=r"row 7 .* chosen video has 6 frames and the rejected 4"):
        collator([{"prompt": "p", "chosen": frames, "rejected": frames[:4], INDEX_KEY: 7}])
    with pytest.raises(ValueError, match="at least num_frames=5"):
        collator([{"prompt": "p", "chosen": frames[:3], "rejected": frames[:3]}])
    missing = collator(
        [
            {"prompt": "p", "chosen": frames, "rejected": [None] * 6},
            {"prompt": "p", "chosen": frames, "rejected": frames},
        ]
    )
    assert missing["num_missing"] == 1 and missing["pixel_values"].shape[0] == 1


def test_image_conditioned_models_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"conditions on \['image'\] \(editing, image-to-video\)"):
        DiffusionDPOTrainer(
            tiny_model_dir("wan-i2v"),
            args=_config(tmp_path, num_frames=TINY_VIDEO_FRAMES),
            train_dataset=_synthetic_pairs("sd", count=2),
        )
