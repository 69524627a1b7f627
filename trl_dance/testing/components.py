"""Shared tiny components: tokenizers built in memory, small text encoders and VAEs, the build helper."""

from __future__ import annotations

import json
import string
from collections.abc import Callable

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    GemmaTokenizer,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2TokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

from ..tiny_folders import TINY_RESOLUTION

_CHARS = string.ascii_lowercase + string.digits + ".,!?'-"


_CLIP_DIM = 32


# SD's 0.18215 (SDXL's 0.13025) gives its trained VAE unit-variance latents; on these random VAEs it would shrink the
# latents to std ~0.04, ten times below the flow pipelines', and drown image differences in the noise. 1.5 puts
# every tiny pipeline's scaled latents at std ~0.4.
_UNET_VAE_SCALING = 1.5

_PREFERENCE_PROMPTS = ["a cat", "a dog", "a red house", "blue sky", "green tree", "old car", "big ship", "sun set"]

_QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)


def _clip_tokenizer(chars: str = _CHARS, max_length: int = 77) -> CLIPTokenizer:
    # Character-level BPE (no merges): every prompt tokenizes without any downloaded vocabulary.
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in chars:
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    return CLIPTokenizer(
        vocab=vocab,
        merges=[],
        model_max_length=max_length,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def _t5_tokenizer(chars: str = _CHARS + string.ascii_uppercase) -> T5Tokenizer:
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in chars] + [("▁" + c, -2.5) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def _clip_text_encoder(tokenizer: CLIPTokenizer, with_projection: bool = False) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_CLIP_DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=_CLIP_DIM,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
        attention_dropout=0.0,
        dropout=0.0,
    )
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def _t5_encoder(tokenizer: T5Tokenizer, d_model: int, umt5: bool = False) -> T5EncoderModel | UMT5EncoderModel:
    config = (UMT5Config if umt5 else T5Config)(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return (UMT5EncoderModel if umt5 else T5EncoderModel)(config)


def _vae(latent_channels: int, scaling_factor: float, shift_factor: float | None) -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        # One normalisation group: with several, the decoder's GroupNorms remove latent offsets and a random VAE's
        # brightness barely depends on its latents, leaving a tiny policy nothing to learn.
        norm_num_groups=1,
        sample_size=TINY_RESOLUTION,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=shift_factor is None,
        use_post_quant_conv=shift_factor is None,
    )


def _build(factory: Callable[[], DiffusionPipeline], seed: int) -> DiffusionPipeline:
    # Fork the global RNG so building a pipeline does not perturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipeline = factory()
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# Qwen3's chat template as the FLUX.2 [klein] pipeline renders it (a user turn, the assistant's turn opened, and the
# empty reasoning block that enable_thinking=False writes).
_QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _qwen3_tokenizer() -> Qwen2TokenizerFast:
    """The tiny Qwen tokenizer with Qwen3's chat template (FLUX.2 [klein] and Z-Image template their prompts)."""
    tokenizer = _qwen_tokenizer()
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    return tokenizer


def _qwen3(cls: type, tokenizer: Qwen2TokenizerFast, layers: int) -> Qwen3Model | Qwen3ForCausalLM:
    """A tiny Qwen3 text encoder of class ``cls`` with ``layers`` layers."""
    return cls(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=1024,
        )
    )


TINY_VIDEO_FRAMES = 5


def _qwen_tokenizer(corpus: str | None = None, vocab_size: int = 600) -> Qwen2TokenizerFast:
    """A byte-level BPE Qwen2 tokenizer with Qwen2-VL's special tokens, trained on ``corpus`` (default: Qwen-Image's
    prompt template, so that its words are single tokens and the template's system prefix is 34 tokens, as with the
    real tokenizer) with ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
    specials += ["<|image_pad|>", "<|video_pad|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
        show_progress=False,
    )
    backend.train_from_iterator([corpus or _QWEN_IMAGE_TEMPLATE.format("a")] * 50, trainer)
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    return tokenizer


def _qwen25_vl(tokenizer: Qwen2TokenizerFast) -> Qwen2_5_VLForConditionalGeneration:
    """A Qwen2.5-VL (Qwen-Image's text encoder; its vision tower reads Qwen-Image-Edit's source images)."""
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "fullatt_block_indexes": [0],
            "window_size": 56,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


# Llama 3's pre-tokenizer pattern: with it, a BPE trained on HunyuanVideo's prompt template splits the template's
# system prefix into the 95 tokens the pipeline crops (its DEFAULT_PROMPT_TEMPLATE's crop_start), as Llama 3 does.
_LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _llama_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE Llama 3 tokenizer (its pre-tokenizer, special tokens and BOS) trained on HunyuanVideo's prompt
    template."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
        show_progress=False,
    )
    backend.train_from_iterator([DEFAULT_PROMPT_TEMPLATE["template"].format("a")] * 50, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    # Llama 3 checkpoints ship their tokenizer as a PreTrainedTokenizerFast (tokenizer.json).
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
    )


def _gemma_tokenizer() -> GemmaTokenizer:
    """A Gemma tokenizer (byte-fallback BPE on "▁"-joined words, BOS first, Gemma 3's image tokens) with a small
    vocabulary trained on the tiny prompts' alphabet."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>", "<end_of_image>"]
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")  # as GemmaTokenizer builds its own
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=[*specials, "<image_soft_token>"],
        initial_alphabet=list(_CHARS + "▁"),
        show_progress=False,
    )
    backend.train_from_iterator([" ".join(_PREFERENCE_PROMPTS)] * 20, trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in model["merges"]]
    return GemmaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True)


def _gemma3(tokenizer: GemmaTokenizer) -> Gemma3ForConditionalGeneration:
    """A Gemma 3 (LTX-2's text encoder, of which the pipeline reads every hidden state), with a tiny SigLIP tower."""
    ids = tokenizer.convert_tokens_to_ids
    return Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "max_position_embeddings": 2048,
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            vision_config={
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 16,
                "patch_size": 8,
            },
            mm_tokens_per_image=4,
            boi_token_index=ids("<start_of_image>"),
            eoi_token_index=ids("<end_of_image>"),
            image_token_index=ids("<image_soft_token>"),
        )
    )


def _qwen3_vl(tokenizer: Qwen2TokenizerFast, width: int, layers: int, heads: int) -> Qwen3VLForConditionalGeneration:
    """A tiny Qwen3-VL conditioner (Qwen-Image 2.1, MiniMax-H3): a text stack of ``layers`` layers of ``width`` with
    ``heads`` query heads of 8 (half as many key/value heads), and a one-block vision tower whose merged tokens cover
    32×32 pixels (16-pixel patches merged 2×2: one 2×2 group of a 16× VAE's latents)."""
    ids = tokenizer.convert_tokens_to_ids
    return Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": width,
                "intermediate_size": 2 * width,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": heads // 2,
                "head_dim": 8,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
            },
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_heads": 2,
                "out_hidden_size": width,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "num_position_embeddings": 64,
                "deepstack_visual_indexes": [0],
            },
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        )
    )
