"""The text task's model: a small Stable Diffusion 3 pipeline (the classes, scheduler and prediction type SD3.5
ships) whose VAE and transformer this project trains to render words, so that RL starts from a model that spells
some held-out words right and many wrong.

Built in two stages by one seeded command (``python -m trl_dance.text_task build DIR``): the VAE learns to
reconstruct rendered words in six fonts (L1 + a small KL), its latent statistics become ``shift_factor`` and
``scaling_factor`` (SD3's convention), then :class:`~trl_dance.DiffusionSFTTrainer` pretrains the transformer by flow
matching on (prompt, image) rows in two fonts (:data:`~trl_dance.text_task.render.TEXT_STYLE`). The text encoders stay random: character-level tokenizers hand
each letter to CLIP (absolute positions) and T5 (relative ones), and the transformer learns to read them.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel

from ..testing.components import _build, _clip_tokenizer, _t5_tokenizer
from .render import IMAGE_SIZE, TEXT_STYLE, VAE_STYLE, Style, render_word
from .words import ALPHABET, prompt_for, word_split

TEXT_MODEL_DIR = os.path.join(os.path.dirname(__file__), "model")
"""Where the shipped, trained pipeline lies (``StableDiffusion3Pipeline.from_pretrained(TEXT_MODEL_DIR)``)."""

SAMPLING = {"height": IMAGE_SIZE, "width": IMAGE_SIZE, "num_inference_steps": 10, "guidance_scale": 4.5,
            "max_sequence_length": 32}  # fmt: skip
"""How the task samples: Flow-GRPO's OCR setting (10 steps, CFG 4.5) at the model's 64 px."""

VAE_STEPS = 700
SFT_STEPS = 3750
"""The build's stage lengths: the shipped model is step 3,750 of a constant-rate SFT run (docs/text-task.md)."""

_CHARS = ALPHABET + "\"'.,!?-"
"""The tokenizers' characters (one token each): the letters and the double quote the prompts hold."""
_CLIP_DIM = 32
_CLIP_TOKENS = 32
"""CLIP's context (77 in SD3): the pipeline pads every prompt to it, and fewer padding tokens leave the letters' tokens
a larger share of the transformer's attention (the prompts here take 19 tokens and a word of up to 13 letters fits)."""
_LATENT_CHANNELS = 4


def _clip(tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    """A random CLIP text encoder whose hidden states keep each token and its position apart: token and position
    embeddings of unit scale (CLIP's initialisation, 0.02, lets its random layers average every position with the
    ones before it, and the transformer then took far longer to learn which letter sits where)."""
    encoder = CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=_CLIP_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=_CLIP_TOKENS, projection_dim=_CLIP_DIM,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, hidden_act="gelu", attention_dropout=0.0, dropout=0.0,
        )
    )  # fmt: skip
    embeddings = encoder.text_model.embeddings
    with torch.no_grad():
        embeddings.token_embedding.weight.normal_(0.0, 1.0)
        embeddings.position_embedding.weight.normal_(0.0, 1.0)
    return encoder


def untrained_pipeline(seed: int = 0) -> StableDiffusion3Pipeline:
    """The pipeline before training: SD3.5's classes and scheduler (``shift=3``), random weights, float32."""

    def factory() -> StableDiffusion3Pipeline:
        tokenizer, tokenizer_2 = _clip_tokenizer(_CHARS, _CLIP_TOKENS), _clip_tokenizer(_CHARS, _CLIP_TOKENS)
        tokenizer_3 = _t5_tokenizer(_CHARS)
        t5 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_3), d_model=2 * _CLIP_DIM, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                pad_token_id=tokenizer_3.pad_token_id, eos_token_id=tokenizer_3.eos_token_id,
            )
        )  # fmt: skip
        vae = AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(32, 32), layers_per_block=1, latent_channels=_LATENT_CHANNELS, norm_num_groups=32,
            sample_size=IMAGE_SIZE, use_quant_conv=False, use_post_quant_conv=False,  # SD3's VAE has neither
            mid_block_add_attention=False,  # SD3's has it; over 32² positions it tripled the training step's time
            scaling_factor=1.0, shift_factor=0.0,  # set from the trained VAE's latents
        )  # fmt: skip
        latent = IMAGE_SIZE // 2
        transformer = SD3Transformer2DModel(
            sample_size=latent, patch_size=4, in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS,
            num_layers=4, attention_head_dim=32, num_attention_heads=4, joint_attention_dim=2 * _CLIP_DIM,
            caption_projection_dim=128, pooled_projection_dim=2 * _CLIP_DIM, pos_embed_max_size=latent // 4,
            qk_norm="rms_norm",  # SD3.5's
        )  # fmt: skip
        return StableDiffusion3Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae, text_encoder=_clip(tokenizer), tokenizer=tokenizer, text_encoder_2=_clip(tokenizer_2),
            tokenizer_2=tokenizer_2, text_encoder_3=t5, tokenizer_3=tokenizer_3, transformer=transformer,
        )  # fmt: skip

    return _build(factory, seed)  # seeded, the caller's random stream untouched, in eval mode


def rendered_rows(words: Sequence[str], seed: int, style: Style = VAE_STYLE) -> Iterator[dict]:
    """Endless ``{"prompt", "image"}`` rows: a random word of ``words`` in a random ``style`` (:func:`render_word`)."""
    rng = random.Random(seed)
    while True:
        word = rng.choice(words)
        yield {"prompt": prompt_for(word), "image": render_word(word, rng, style=style)}


def _pixels(images) -> torch.Tensor:
    """PIL images → (B, 3, H, W) float in [-1, 1]."""
    return torch.from_numpy(np.stack([np.asarray(i) for i in images])).permute(0, 3, 1, 2).float() / 127.5 - 1


def train_vae(vae: AutoencoderKL, words: list[str], steps: int, batch_size: int = 16, learning_rate: float = 1e-3,
              kl_weight: float = 1e-6, seed: int = 0, log_every: int = 50) -> None:  # fmt: skip
    """Train ``vae`` in place to reconstruct rendered ``words`` (L1 + ``kl_weight`` × KL), then set its
    ``shift_factor`` and ``scaling_factor`` so that scaled latents have mean 0 and std 1 (SD3's convention)."""
    rows = rendered_rows(words, seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    vae.train()
    start = time.perf_counter()
    for step in range(steps):
        x = _pixels(row["image"] for row in itertools.islice(rows, batch_size))
        posterior = vae.encode(x).latent_dist
        reconstruction = vae.decode(posterior.sample(generator)).sample
        l1 = (reconstruction - x).abs().mean()
        loss = l1 + kl_weight * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            print(f"vae step {step + 1}/{steps}: L1 {l1.item():.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    vae.eval()
    with torch.no_grad():
        latents = torch.cat([vae.encode(_pixels(r["image"] for r in itertools.islice(rows, 64))).latent_dist.mean
                             for _ in range(8)])  # fmt: skip
    vae.register_to_config(shift_factor=latents.mean().item(), scaling_factor=1 / latents.std().item())


def pretrain_transformer(pipeline: StableDiffusion3Pipeline, words: list[str], output_dir: str, max_steps: int,
                         batch_size: int = 32, learning_rate: float = 1e-3, seed: int = 0,
                         snapshot_steps: int = 0) -> None:  # fmt: skip
    """Train ``pipeline.transformer`` in place by flow matching on rendered ``words`` with
    :class:`~trl_dance.DiffusionSFTTrainer` (full fine-tuning, SD3's logit-normal times, 10 % empty prompts so
    that classifier-free guidance has an unconditional branch, no flips: mirrored letters are other letters). A
    constant learning rate after warm-up, so that the first ``k`` steps of a longer run are the ``k``-step build;
    ``snapshot_steps``: save the whole pipeline every this many steps to ``output_dir/step-<k>`` (to choose ``k``)."""
    from datasets import IterableDataset
    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if snapshot_steps and state.global_step % snapshot_steps == 0:
                pipeline.save_pretrained(os.path.join(output_dir, f"step-{state.global_step}"))

    from ..trainer.diffusion_sft_config import DiffusionSFTConfig
    from ..trainer.diffusion_sft_trainer import DiffusionSFTTrainer

    args = DiffusionSFTConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=seed,
        resolution=IMAGE_SIZE, random_flip=False, proportion_empty_prompts=0.1, weighting_scheme="logit_normal",
        max_sequence_length=SAMPLING["max_sequence_length"], per_device_train_batch_size=batch_size,
        learning_rate=learning_rate, lr_scheduler_type="constant_with_warmup", warmup_steps=min(100, max_steps // 10),
        max_steps=max_steps, logging_steps=50, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    # (A list in gen_kwargs would be split into shards, one word each, read one after the other: bound here instead.)
    dataset = IterableDataset.from_generator(functools.partial(rendered_rows, tuple(words), seed + 1, TEXT_STYLE))
    trainer = DiffusionSFTTrainer(model=pipeline, args=args, train_dataset=dataset, callbacks=[Snapshots()])
    trainer.train()
    pipeline.transformer = trainer.accelerator.unwrap_model(trainer.model).eval()


def build_text_model(output: str, seed: int = 0, vae_steps: int = VAE_STEPS, sft_steps: int = SFT_STEPS,
                     work_dir: str | None = None, snapshot_steps: int = 0) -> StableDiffusion3Pipeline:  # fmt: skip
    """Build the text task's pipeline from scratch and ``save_pretrained`` it to ``output`` (with its sampling
    settings beside, as a tiny pipeline's): VAE, then transformer, on the training words only. Deterministic for a
    given ``seed`` on a given machine and thread count. The trained VAE and the SFT stage's files go to ``work_dir``
    (default ``<output>.build``); a VAE already trained there is reused."""
    import json

    from ..tiny_folders import TINY_SAMPLING_FILE

    start = time.perf_counter()
    work_dir = work_dir or output.rstrip("/") + ".build"
    train_words, _ = word_split()
    pipeline = untrained_pipeline(seed)
    vae_dir = os.path.join(work_dir, "vae")
    if os.path.isfile(os.path.join(vae_dir, "config.json")):
        pipeline.vae = AutoencoderKL.from_pretrained(vae_dir).eval()
    else:
        train_vae(pipeline.vae, train_words, vae_steps, seed=seed)
        pipeline.vae.save_pretrained(vae_dir)
    print(f"VAE ready ({time.perf_counter() - start:.0f} s)", flush=True)
    pretrain_transformer(pipeline, train_words, os.path.join(work_dir, "sft"), sft_steps, seed=seed,
                         snapshot_steps=snapshot_steps)  # fmt: skip
    pipeline.save_pretrained(output)
    with open(os.path.join(output, TINY_SAMPLING_FILE), "w") as handle:
        json.dump(SAMPLING, handle, indent=2)
    print(f"built {output} in {time.perf_counter() - start:.0f} s", flush=True)
    return pipeline
