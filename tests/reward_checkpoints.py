"""Tiny random reward checkpoints in the published formats, written offline, and independent reference forwards.

The reference forwards below follow the original architectures (open_clip's ViT/text transformer with fused
attention projections; BLIP's ViT and BERT with cross-attention) in plain torch, so they check the adapters'
key mappings and configs rather than repeating them.
"""

from __future__ import annotations

import os
import string
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import BertTokenizer, CLIPConfig, CLIPModel, CLIPTokenizer

_CHARS = string.ascii_lowercase + string.digits + ".,!?'-"

TINY_OPEN_CLIP = {
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "patch_size": 8,
        "image_size": 32,
        "hidden_act": "gelu",
    },
    "text_config": {
        "hidden_size": 24,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 77,
        "vocab_size": 2 + 2 * len(_CHARS),
        "hidden_act": "gelu",
    },
    "projection_dim": 16,
}

TINY_BLIP = {
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "patch_size": 8,
        "image_size": 32,
    },
    "text_config": {
        "vocab_size": 7 + len(_CHARS),
        "hidden_size": 24,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 40,
    },
}


def save_clip_tokenizer(directory: str) -> str:
    """A character-level CLIP BPE tokenizer whose start/end tokens have the two highest ids, as in CLIP's vocab."""
    vocab = {}
    for char in _CHARS:
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = CLIPTokenizer(
        vocab=vocab,
        merges=[],
        model_max_length=77,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="!",  # open_clip pads with id 0 ("!" in the laion tokenizer); here "a" is 0, "!" another id
    )
    tokenizer.save_pretrained(directory)
    return directory


# HPS v2's package builds open_clip's text tower with its own tokenizer (CLIP's 49,408-token BPE) and a fixed MLP
# ratio of 4: the architecture its scoring function can be checked on.
TINY_HPS = {
    **TINY_OPEN_CLIP,
    "text_config": {**TINY_OPEN_CLIP["text_config"], "vocab_size": 49408, "intermediate_size": 96},
}


# ImageReward's package builds its BLIP at 224 px (patches of 32 here: 49 tokens).
TINY_IMAGE_REWARD = {**TINY_BLIP, "vision_config": {**TINY_BLIP["vision_config"], "image_size": 224, "patch_size": 32}}


def save_open_clip_bpe_tokenizer(directory: str, pad_token: str = "!") -> str:
    """transformers' ``CLIPTokenizer`` files written from open_clip's own BPE table: the vocabulary every CLIP
    checkpoint uses; pad token ``"!"`` as ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``'s, ``"<|endoftext|>"`` as
    ``openai/clip-vit-large-patch14``'s."""
    import gzip
    import json

    from open_clip.tokenizer import bytes_to_unicode, default_bpe

    with gzip.open(default_bpe()) as handle:
        merges = handle.read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]  # open_clip's SimpleTokenizer
    tokens = list(bytes_to_unicode().values())
    tokens += [token + "</w>" for token in tokens] + ["".join(merge.split()) for merge in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "vocab.json"), "w") as handle:
        json.dump({token: index for index, token in enumerate(tokens)}, handle)
    with open(os.path.join(directory, "merges.txt"), "w") as handle:
        handle.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    tokenizer = CLIPTokenizer(
        os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt"), pad_token=pad_token
    )
    tokenizer.save_pretrained(directory)
    return directory


def save_bert_tokenizer(directory: str) -> str:
    """A character-level uncased BERT tokenizer with BLIP's extra ``[DEC]`` and ``[ENC]`` tokens."""
    os.makedirs(directory, exist_ok=True)
    vocab_file = os.path.join(directory, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_CHARS]) + "\n")
    tokenizer = BertTokenizer(vocab_file, do_lower_case=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    tokenizer.save_pretrained(directory)
    return directory


def _random(generator: torch.Generator, *shape: int, std: float = 0.1) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * std


def _layer_norm(sd: dict, generator: torch.Generator, prefix: str, width: int) -> None:
    sd[prefix + ".weight"] = 1 + _random(generator, width)
    sd[prefix + ".bias"] = _random(generator, width)


def _linear(sd: dict, generator: torch.Generator, prefix: str, fan_out: int, fan_in: int) -> None:
    sd[prefix + ".weight"] = _random(generator, fan_out, fan_in, std=fan_in**-0.5)
    sd[prefix + ".bias"] = _random(generator, fan_out)


# --------------------------------------------------------------------------------------------------------------
# HPS v2 (open_clip layout)


def _open_clip_blocks(sd: dict, generator: torch.Generator, prefix: str, config: dict) -> None:
    width, hidden = config["hidden_size"], config["intermediate_size"]
    for i in range(config["num_hidden_layers"]):
        p = f"{prefix}transformer.resblocks.{i}"
        _layer_norm(sd, generator, f"{p}.ln_1", width)
        sd[f"{p}.attn.in_proj_weight"] = _random(generator, 3 * width, width, std=width**-0.5)
        sd[f"{p}.attn.in_proj_bias"] = _random(generator, 3 * width)
        _linear(sd, generator, f"{p}.attn.out_proj", width, width)
        _layer_norm(sd, generator, f"{p}.ln_2", width)
        _linear(sd, generator, f"{p}.mlp.c_fc", hidden, width)
        _linear(sd, generator, f"{p}.mlp.c_proj", width, hidden)


def open_clip_state_dict(architecture: dict = TINY_OPEN_CLIP, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random open_clip CLIP state dict with the key layout of ``HPS_v2.1_compressed.pt``'s ``state_dict``."""
    g = torch.Generator().manual_seed(seed)
    vision, text = architecture["vision_config"], architecture["text_config"]
    width, patch, dim = vision["hidden_size"], vision["patch_size"], architecture["projection_dim"]
    grid = vision["image_size"] // patch
    sd = {
        "visual.conv1.weight": _random(g, width, 3, patch, patch, std=(3 * patch * patch) ** -0.5),
        "visual.class_embedding": _random(g, width),
        "visual.positional_embedding": _random(g, grid * grid + 1, width),
    }
    _layer_norm(sd, g, "visual.ln_pre", width)
    _open_clip_blocks(sd, g, "visual.", vision)
    _layer_norm(sd, g, "visual.ln_post", width)
    sd["visual.proj"] = _random(g, width, dim, std=width**-0.5)
    text_width = text["hidden_size"]
    sd["token_embedding.weight"] = _random(g, text["vocab_size"], text_width)
    sd["positional_embedding"] = _random(g, text["max_position_embeddings"], text_width)
    _open_clip_blocks(sd, g, "", text)
    _layer_norm(sd, g, "ln_final", text_width)
    sd["text_projection"] = _random(g, text_width, dim, std=text_width**-0.5)
    sd["logit_scale"] = torch.tensor(4.6052)
    return sd


def _ln(x, sd, prefix, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], sd[prefix + ".weight"], sd[prefix + ".bias"], eps)


def _open_clip_transformer(x, sd, prefix, config, causal):
    width, length = x.shape[-1], x.shape[1]
    mask = torch.full((length, length), float("-inf")).triu(1) if causal else None
    for i in range(config["num_hidden_layers"]):
        p = f"{prefix}transformer.resblocks.{i}"
        h = _ln(x, sd, f"{p}.ln_1").transpose(0, 1)  # nn.MultiheadAttention's (L, B, D)
        attended, _ = F.multi_head_attention_forward(
            h, h, h, width, config["num_attention_heads"],
            sd[f"{p}.attn.in_proj_weight"], sd[f"{p}.attn.in_proj_bias"], None, None, False, 0.0,
            sd[f"{p}.attn.out_proj.weight"], sd[f"{p}.attn.out_proj.bias"],
            training=False, need_weights=False, attn_mask=mask,
        )  # fmt: skip
        x = x + attended.transpose(0, 1)
        h = F.gelu(F.linear(_ln(x, sd, f"{p}.ln_2"), sd[f"{p}.mlp.c_fc.weight"], sd[f"{p}.mlp.c_fc.bias"]))
        x = x + F.linear(h, sd[f"{p}.mlp.c_proj.weight"], sd[f"{p}.mlp.c_proj.bias"])
    return x


def open_clip_image_features(sd: dict, architecture: dict, pixels: torch.Tensor) -> torch.Tensor:
    """open_clip ``encode_image`` (unnormalised): (B, 3, S, S) normalised pixels → (B, P)."""
    vision = architecture["vision_config"]
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=vision["patch_size"]).flatten(2).transpose(1, 2)
    cls = sd["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = _ln(torch.cat([cls, x], dim=1) + sd["visual.positional_embedding"], sd, "visual.ln_pre")
    x = _open_clip_transformer(x, sd, "visual.", vision, causal=False)
    return _ln(x[:, 0], sd, "visual.ln_post") @ sd["visual.proj"]


def open_clip_text_features(sd: dict, architecture: dict, token_ids: torch.Tensor) -> torch.Tensor:
    """open_clip ``encode_text`` (unnormalised): (B, L) ids, pooled at the highest id (the end token) → (B, P)."""
    x = sd["token_embedding.weight"][token_ids] + sd["positional_embedding"][: token_ids.shape[1]]
    x = _ln(_open_clip_transformer(x, sd, "", architecture["text_config"], causal=True), sd, "ln_final")
    return x[torch.arange(x.shape[0]), token_ids.argmax(dim=-1)] @ sd["text_projection"]


# --------------------------------------------------------------------------------------------------------------
# ImageReward (BLIP layout)


def image_reward_state_dict(architecture: dict = TINY_BLIP, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random state dict with the key layout of ``ImageReward.pt`` (``blip.visual_encoder``, ``blip.text_encoder``,
    unused BLIP projections, ``mlp.layers``)."""
    g = torch.Generator().manual_seed(seed)
    vision, text = architecture["vision_config"], architecture["text_config"]
    width, patch, hidden = vision["hidden_size"], vision["patch_size"], vision["intermediate_size"]
    grid = vision["image_size"] // patch
    v = "blip.visual_encoder"
    sd = {
        f"{v}.cls_token": _random(g, 1, 1, width),
        f"{v}.pos_embed": _random(g, 1, grid * grid + 1, width),
        f"{v}.patch_embed.proj.weight": _random(g, width, 3, patch, patch, std=(3 * patch * patch) ** -0.5),
        f"{v}.patch_embed.proj.bias": _random(g, width),
    }
    for i in range(vision["num_hidden_layers"]):
        _layer_norm(sd, g, f"{v}.blocks.{i}.norm1", width)
        _linear(sd, g, f"{v}.blocks.{i}.attn.qkv", 3 * width, width)
        _linear(sd, g, f"{v}.blocks.{i}.attn.proj", width, width)
        _layer_norm(sd, g, f"{v}.blocks.{i}.norm2", width)
        _linear(sd, g, f"{v}.blocks.{i}.mlp.fc1", hidden, width)
        _linear(sd, g, f"{v}.blocks.{i}.mlp.fc2", width, hidden)
    _layer_norm(sd, g, f"{v}.norm", width)

    t, tw, th = "blip.text_encoder", text["hidden_size"], text["intermediate_size"]
    sd[f"{t}.embeddings.word_embeddings.weight"] = _random(g, text["vocab_size"], tw)
    sd[f"{t}.embeddings.position_embeddings.weight"] = _random(g, text["max_position_embeddings"], tw)
    sd[f"{t}.embeddings.position_ids"] = torch.arange(text["max_position_embeddings"])[None]
    _layer_norm(sd, g, f"{t}.embeddings.LayerNorm", tw)
    for i in range(text["num_hidden_layers"]):
        p = f"{t}.encoder.layer.{i}"
        for attention, source in (("attention", tw), ("crossattention", width)):
            _linear(sd, g, f"{p}.{attention}.self.query", tw, tw)
            _linear(sd, g, f"{p}.{attention}.self.key", tw, source)
            _linear(sd, g, f"{p}.{attention}.self.value", tw, source)
            _linear(sd, g, f"{p}.{attention}.output.dense", tw, tw)
            _layer_norm(sd, g, f"{p}.{attention}.output.LayerNorm", tw)
        _linear(sd, g, f"{p}.intermediate.dense", th, tw)
        _linear(sd, g, f"{p}.output.dense", tw, th)
        _layer_norm(sd, g, f"{p}.output.LayerNorm", tw)
    _linear(sd, g, "blip.vision_proj", 256, width)  # BLIP pre-training leftovers the score does not use
    for index, (fan_out, fan_in) in zip((0, 2, 4, 6, 7), ((1024, tw), (128, 1024), (64, 128), (16, 64), (1, 16))):
        _linear(sd, g, f"mlp.layers.{index}", fan_out, fan_in)
    return sd


def _attention(q_in, kv_in, sd, p, heads, key_mask=None):
    batch, length, width = q_in.shape
    q = F.linear(q_in, sd[f"{p}.query.weight"], sd[f"{p}.query.bias"])
    k = F.linear(kv_in, sd[f"{p}.key.weight"], sd[f"{p}.key.bias"])
    v = F.linear(kv_in, sd[f"{p}.value.weight"], sd[f"{p}.value.bias"])
    q, k, v = (z.view(batch, -1, heads, width // heads).transpose(1, 2) for z in (q, k, v))
    scores = q @ k.transpose(-1, -2) / (width // heads) ** 0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :].bool(), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, width)


def image_reward_raw(
    sd: dict, architecture: dict, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """BLIP ViT → BERT text encoder with cross-attention → [CLS] → MLP head, before ImageReward's normalisation."""
    vision, text = architecture["vision_config"], architecture["text_config"]
    v, heads = "blip.visual_encoder", vision["num_attention_heads"]
    x = F.conv2d(pixels, sd[f"{v}.patch_embed.proj.weight"], sd[f"{v}.patch_embed.proj.bias"], vision["patch_size"])
    x = torch.cat([sd[f"{v}.cls_token"].expand(x.shape[0], 1, -1), x.flatten(2).transpose(1, 2)], dim=1)
    x = x + sd[f"{v}.pos_embed"]
    for i in range(vision["num_hidden_layers"]):
        p = f"{v}.blocks.{i}"
        h = _ln(x, sd, f"{p}.norm1", 1e-6)
        batch, length, width = h.shape
        qkv = F.linear(h, sd[f"{p}.attn.qkv.weight"], sd[f"{p}.attn.qkv.bias"])
        q, k, w = qkv.view(batch, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
        attended = ((q @ k.transpose(-1, -2)) * (width // heads) ** -0.5).softmax(-1) @ w
        x = x + F.linear(
            attended.transpose(1, 2).reshape(batch, length, width),
            sd[f"{p}.attn.proj.weight"],
            sd[f"{p}.attn.proj.bias"],
        )
        h = F.gelu(F.linear(_ln(x, sd, f"{p}.norm2", 1e-6), sd[f"{p}.mlp.fc1.weight"], sd[f"{p}.mlp.fc1.bias"]))
        x = x + F.linear(h, sd[f"{p}.mlp.fc2.weight"], sd[f"{p}.mlp.fc2.bias"])
    image = _ln(x, sd, f"{v}.norm", 1e-6)

    t, heads = "blip.text_encoder", text["num_attention_heads"]
    y = (
        sd[f"{t}.embeddings.word_embeddings.weight"][ids]
        + sd[f"{t}.embeddings.position_embeddings.weight"][: ids.shape[1]]
    )
    y = _ln(y, sd, f"{t}.embeddings.LayerNorm", 1e-12)

    def residual(out, skip, p):
        return _ln(F.linear(out, sd[f"{p}.dense.weight"], sd[f"{p}.dense.bias"]) + skip, sd, f"{p}.LayerNorm", 1e-12)

    for i in range(text["num_hidden_layers"]):
        p = f"{t}.encoder.layer.{i}"
        y = residual(_attention(y, y, sd, f"{p}.attention.self", heads, mask), y, f"{p}.attention.output")
        y = residual(_attention(y, image, sd, f"{p}.crossattention.self", heads), y, f"{p}.crossattention.output")
        h = F.gelu(F.linear(y, sd[f"{p}.intermediate.dense.weight"], sd[f"{p}.intermediate.dense.bias"]))
        y = residual(h, y, f"{p}.output")
    z = y[:, 0]
    for index in (0, 2, 4, 6, 7):
        z = F.linear(z, sd[f"mlp.layers.{index}.weight"], sd[f"mlp.layers.{index}.bias"])
    return z.squeeze(-1)


# --------------------------------------------------------------------------------------------------------------
# CLIP models saved with save_pretrained (PickScore, CLIP score, aesthetic), and the aesthetic head


def save_tiny_clap(directory: str, seed: int = 0) -> str:
    """A tiny random ``ClapModel`` (HTSAT audio tower of two stages, one-layer RoBERTa text tower) and its
    ``ClapProcessor`` (the published 48 kHz, 64-bin feature extractor with unfused checkpoints' ``rand_trunc``, a
    character-level RoBERTa BPE tokenizer) in the ``save_pretrained`` layout of ``laion/larger_clap_general``."""
    from transformers import (
        ClapAudioConfig,
        ClapConfig,
        ClapFeatureExtractor,
        ClapModel,
        ClapProcessor,
        ClapTextConfig,
        RobertaTokenizer,
    )

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4}
    for char in string.ascii_lowercase + string.digits + "Ġ.,!?'-":
        vocab.setdefault(char, len(vocab))
    tokenizer = RobertaTokenizer(vocab=vocab, merges=[])
    text = ClapTextConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=80, projection_dim=16,
    )  # fmt: skip
    audio = ClapAudioConfig(
        depths=[1, 1], num_attention_heads=[1, 2], hidden_size=16, patch_embeds_hidden_size=8, projection_dim=16
    )
    torch.manual_seed(seed)
    ClapModel(ClapConfig(text_config=text.to_dict(), audio_config=audio.to_dict(), projection_dim=16)).save_pretrained(
        directory
    )
    ClapProcessor(
        feature_extractor=ClapFeatureExtractor(truncation="rand_trunc"), tokenizer=tokenizer
    ).save_pretrained(directory)
    return directory


def save_tiny_clip(directory: str, seed: int = 0) -> str:
    """A tiny random ``CLIPModel`` and its tokenizer in the ``save_pretrained`` layout (like PickScore_v1)."""
    from trl_dance.rewards.hps import clip_config

    torch.manual_seed(seed)
    config: CLIPConfig = clip_config(TINY_OPEN_CLIP)
    CLIPModel(config).save_pretrained(directory)
    return save_clip_tokenizer(directory)


def aesthetic_head_state_dict(input_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with the key layout of ``sac+logos+ava1-l14-linearMSE.pth``."""
    g, sd = torch.Generator().manual_seed(seed), {}
    for index, (fan_out, fan_in) in zip(
        (0, 2, 4, 6, 7), ((1024, input_size), (128, 1024), (64, 128), (16, 64), (1, 16))
    ):
        _linear(sd, g, f"layers.{index}", fan_out, fan_in)
    return sd


# Qwen2-VL-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2-VL-*-Instruct).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def save_tiny_qwen2_vl(directory: str) -> str:
    """A Qwen2-VL-Instruct base in the published layout: config.json, a byte-level Qwen2 tokenizer with Qwen2-VL's
    special tokens and chat template, and preprocessor_config.json (the Qwen2-VL image processor's defaults)."""
    from transformers import Qwen2TokenizerFast, Qwen2VLConfig
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2TokenizerFast(
        vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil().save_pretrained(directory)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 8192,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},
        },
        vision_config={
            "depth": 2,
            "embed_dim": 16,
            "hidden_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
    )
    config.save_pretrained(directory)
    return directory


def qwen2_vl_reward_model(base: str, special_tokens: list[str], head: Callable[[], torch.nn.Module], seed: int):
    """(model, tokenizer): a random ``Qwen2VLForConditionalGeneration`` from ``base`` with the reward tokens added and
    the embeddings resized as the references do, and its ``rm_head`` (built by ``head()``), all from ``seed``."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(base, padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(base), attn_implementation="sdpa")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():  # random init leaves small weights; larger ones make scores differ visibly between inputs
        for parameter in model.parameters():
            parameter.normal_(0, 0.3) if parameter.ndim > 1 else None
    model.rm_head = head()
    return model.eval(), tokenizer


def legacy_qwen2_vl_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's state dict with transformers 4.45 keys (``visual.*``, ``model.*``, ``lm_head``, ``rm_head``), as the
    HPSv3 and VideoAlign checkpoints store it."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.visual."):
            key = key[len("model.") :]
        elif key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model.") :]
        out[key] = value.detach().clone()
    return out


def _byte_vocab() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: index for index, char in enumerate(bytes_to_unicode().values())}


def save_tiny_llava(directory: str, seed: int = 0) -> str:
    """A llava-hf ``LlavaForConditionalGeneration`` (CLIP vision tower, Qwen2 language model, byte-level tokenizer
    with ``<image>``) and its ``LlavaProcessor``, saved with ``save_pretrained``."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, Qwen2TokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vocab = _byte_vocab()
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2TokenizerFast(
        vocab=vocab, merges=[], eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # the CLS token of the vision tower (llava-1.5-hf)
    )
    processor.save_pretrained(directory)
    config = LlavaConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "projection_dim": 16,
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "eos_token_id": tokenizer.eos_token_id,
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    return directory


def save_tiny_deberta(directory: str, seed: int = 0) -> str:
    """A DeBERTa encoder (``microsoft/deberta-xlarge-mnli``'s classes: ``DebertaModel``, the byte-level
    ``DebertaTokenizerFast`` with [CLS]/[SEP]) of 3 layers."""
    from transformers import DebertaConfig, DebertaModel, DebertaTokenizerFast

    vocab = _byte_vocab()
    for token in ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"):
        vocab[token] = len(vocab)
    tokenizer = DebertaTokenizerFast(
        vocab=vocab,
        merges=[],
        bos_token="[CLS]",
        eos_token="[SEP]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        mask_token="[MASK]",
    )
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    config = DebertaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4
    )
    DebertaModel(config).save_pretrained(directory)
    return directory


def save_tiny_step_aware_model(path: str, clip_directory: str, identity: bool = False, seed: int = 0) -> str:
    """A ``.bin`` in the layout of SPO's step-aware preference models over the tiny CLIP of ``clip_directory``:
    ``model.`` + its CLIPModel keys, ``model.t_embedder.mlp.{0,2}``, per-layer ``adaLN_modulation.1`` (6 × width) and
    the pooled ``adaLN_modulation.1`` (2 × width). ``identity``: zero modulation weights and (shift, scale, gate) =
    (0, 0, 1), so the model is the plain CLIP."""
    g = torch.Generator().manual_seed(seed)
    clip = CLIPModel.from_pretrained(clip_directory)
    width, layers = clip.config.vision_config.hidden_size, clip.config.vision_config.num_hidden_layers
    state = {f"model.{k}": v for k, v in clip.state_dict().items()}
    _linear(state, g, "model.t_embedder.mlp.0", width, 256)
    _linear(state, g, "model.t_embedder.mlp.2", width, width)

    def modulation(prefix: str, chunks: int) -> None:
        _linear(state, g, prefix, chunks * width, width)
        if identity:
            state[f"{prefix}.weight"].zero_()
            bias = torch.zeros(chunks * width)
            if chunks == 6:  # the two gates
                bias[2 * width : 3 * width] = bias[5 * width :] = 1
            state[f"{prefix}.bias"] = bias

    for i in range(layers):
        modulation(f"model.vision_model.encoder.layers.{i}.adaLN_modulation.1", 6)
    modulation("model.vision_model.adaLN_modulation.1", 2)
    torch.save(state, path)
    return path
