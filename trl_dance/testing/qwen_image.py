"""Tiny Qwen-Image, Qwen-Image-Edit(-Plus) and Qwen-Image 2.1 pipelines."""

from __future__ import annotations

import tempfile

from diffusers import (
    AutoencoderKLQwenImage,
    AutoencoderKLQwenImage21,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import (
    AutoTokenizer,
    Qwen3VLProcessor,
)

from ..tiny_folders import qwen_vl_processor
from .components import _build, _qwen3_vl, _qwen25_vl, _qwen_tokenizer

# Qwen-Image's prompt template: its encoder drops the first 34 tokens, the system prefix as the real tokenizer splits it.


# Qwen-Image-Edit's system prompt (Edit-Plus adds "Picture 1: " before each source image).
_QWEN_IMAGE_EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def qwen_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Qwen-Image's published scheduler configuration (exponential resolution-dependent shift, terminal σ 0.02)."""
    return FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )


def _qwen_image_components(zero_cond_t: bool = False, editing: bool = False) -> dict:
    """Qwen-Image's components (MMDiT, Qwen2.5-VL text encoder, Wan-style VAE with per-channel latent statistics), the
    tokenizer trained on the editing pipelines' system prompt with ``editing``."""
    tokenizer = _qwen_tokenizer(_QWEN_IMAGE_EDIT_TEMPLATE.format("a") if editing else None)
    if editing:  # as it loads back (its saved pre-tokenizer splits "Picture 1: " otherwise than the trained one)
        with tempfile.TemporaryDirectory() as folder:
            tokenizer.save_pretrained(folder)
            tokenizer = AutoTokenizer.from_pretrained(folder)
    return {
        "scheduler": qwen_image_scheduler(),
        "vae": AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 2],
            num_res_blocks=1,
            temperal_downsample=[False],
            # The first 4 channels' statistics of Qwen-Image's published VAE config.
            latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
            latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
        ),
        "text_encoder": _qwen25_vl(tokenizer),
        "tokenizer": tokenizer,
        "transformer": QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
            zero_cond_t=zero_cond_t,
        ),
    }


def tiny_qwen_image_pipeline(seed: int = 0) -> QwenImagePipeline:
    """A QwenImagePipeline (MMDiT, Qwen2.5-VL text encoder, Wan-style VAE with per-channel latent statistics)."""
    return _build(lambda: QwenImagePipeline(**_qwen_image_components()), seed)


def _qwen_image_edit(cls: type, seed: int, zero_cond_t: bool) -> DiffusionPipeline:
    """A Qwen-Image-Edit pipeline of class ``cls``: Qwen-Image's components and Qwen2-VL's processor, whose images the
    text encoder's vision tower reads with the instruction."""

    def factory():
        components = _qwen_image_components(zero_cond_t=zero_cond_t, editing=True)
        return cls(**components, processor=qwen_vl_processor(components["tokenizer"]))

    return _build(factory, seed)


def tiny_qwen_image_edit_pipeline(seed: int = 0) -> QwenImageEditPipeline:
    """A QwenImageEditPipeline (Qwen-Image-Edit, one source image)."""
    return _qwen_image_edit(QwenImageEditPipeline, seed, zero_cond_t=False)


def tiny_qwen_image_edit_plus_pipeline(seed: int = 0) -> QwenImageEditPlusPipeline:
    """A QwenImageEditPlusPipeline (Qwen-Image-Edit-2509/2511, several source images), with the 2511 transformer's
    ``zero_cond_t`` (the source tokens modulated at timestep 0)."""
    return _qwen_image_edit(QwenImageEditPlusPipeline, seed, zero_cond_t=True)


# Qwen-Image 2.1's text-to-image prompt template, and a Qwen-VL chat template that renders its system message (the
# pipeline drops as many leading tokens as that message has).
_QWEN_IMAGE21_TEMPLATE = (
    "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


_QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{% if message.content is string %}"
    "{{ message.content }}{% else %}{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen_image21_pipeline(seed: int = 0) -> QwenImage21Pipeline:
    """A QwenImage21Pipeline (Qwen-Image 2.1: a single-stream block-causal transformer on unpatched 64-channel latents
    here 8, a Qwen3-VL text encoder read before its final norm, a 16× RGBA VAE with per-channel statistics, a shipped
    ``sample_sigmas`` grid of 8 steps), 32×32 images (one 2×2 latent group)."""

    def factory():
        tokenizer = _qwen_tokenizer(_QWEN_IMAGE21_TEMPLATE.format("a"))
        tokenizer.chat_template = _QWEN_VL_CHAT_TEMPLATE
        text_encoder = _qwen3_vl(tokenizer, width=32, layers=2, heads=4)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        # (its smallest image 32² instead of 56²: a 32² condition image is read as one merged vision token, the one
        # slot of its 2×2 latents)
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=16,
            merge_size=2,
            temporal_patch_size=2,
            size={"shortest_edge": 32 * 32, "longest_edge": 1 << 20},
        )
        channels = 8
        return QwenImage21Pipeline(
            # Qwen-Image's scheduler (resolution-dependent shift) and a non-uniform shipped grid of 8 σ before shifting.
            scheduler=qwen_image_scheduler(),
            vae=AutoencoderKLQwenImage21(
                base_dim=8,
                decoder_base_dim=8,
                z_dim=channels,
                dim_mult=[1, 1, 1, 1, 1],  # five stages: the 16× spatial compression the pipeline assumes
                num_res_blocks=1,
                temperal_downsample=[False, True, True, True],
                # The first 8 channels' statistics of the published VAE's defaults.
                latents_mean=[0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722],
                latents_std=[3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.7910],
            ),
            text_encoder=text_encoder,
            processor=qwen_vl_processor(tokenizer, image_processor, Qwen3VLProcessor),
            transformer=QwenImage21Transformer2DModel(
                patch_size=1,
                in_channels=channels,
                out_channels=channels,
                num_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                context_in_dim=32,
                mlp_ratio=2,
                axes_dims_rope=(4, 6, 6),
            ),
            sample_sigmas=[1.0, 0.96, 0.9, 0.8, 0.65, 0.45, 0.25, 0.1],
        )

    return _build(factory, seed)
