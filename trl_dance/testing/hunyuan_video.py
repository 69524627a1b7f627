"""Tiny HunyuanVideo, SkyReels-V1 image-to-video and HunyuanVideo 1.5 (T2V, I2V) pipelines."""

from __future__ import annotations

import inspect
import tempfile

import jinja2
from diffusers import (
    AutoencoderKLHunyuanVideo,
    AutoencoderKLHunyuanVideo15,
    FlowMatchEulerDiscreteScheduler,
    HunyuanSkyreelsImageToVideoPipeline,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
)
from transformers import (
    AutoTokenizer,
    ByT5Tokenizer,
    LlamaConfig,
    LlamaModel,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
)

from .components import (
    _CLIP_DIM,
    _QWEN3_CHAT_TEMPLATE,
    TINY_RESOLUTION,
    _build,
    _clip_text_encoder,
    _clip_tokenizer,
    _llama_tokenizer,
    _qwen_tokenizer,
    _t5_encoder,
)


def hunyuan_video_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """HunyuanVideo's published scheduler configuration (shift 7)."""
    return FlowMatchEulerDiscreteScheduler(shift=7.0)


def _hunyuan_components(image_to_video: bool = False) -> dict:
    """Tiny HunyuanVideo components: a dual/single-stream transformer (embedded guidance; SkyReels-V1 I2V: none, and
    the image latents as extra input channels), Llama + CLIP text encoders, a causal 3D VAE compressing frames by 4 and
    pixels by 2."""
    tokenizer, tokenizer_2 = _llama_tokenizer(), _clip_tokenizer()
    llama = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,  # the pipeline reads the third hidden state from the end
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    blocks = 3  # frames by 4 (two temporal downsamplings), pixels by 2
    return {
        "scheduler": hunyuan_video_scheduler(),
        "vae": AutoencoderKLHunyuanVideo(
            latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * blocks,
            up_block_types=("HunyuanVideoUpBlock3D",) * blocks,
            block_out_channels=(8,) * blocks,
            layers_per_block=1,
            norm_num_groups=4,
            spatial_compression_ratio=2,
            temporal_compression_ratio=4,
        ),
        "text_encoder": LlamaModel(llama),
        "tokenizer": tokenizer,
        "text_encoder_2": _clip_text_encoder(tokenizer_2),
        "tokenizer_2": tokenizer_2,
        "transformer": HunyuanVideoTransformer3DModel(
            in_channels=8 if image_to_video else 4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=not image_to_video,
            text_embed_dim=32,
            pooled_projection_dim=_CLIP_DIM,
            rope_axes_dim=(4, 6, 6),
        ),
    }


def tiny_hunyuan_video_pipeline(seed: int = 0) -> HunyuanVideoPipeline:
    """A HunyuanVideoPipeline: videos of ``TINY_VIDEO_FRAMES`` frames of 32×32, or one frame (text-to-image)."""
    return _build(lambda: HunyuanVideoPipeline(**_hunyuan_components()), seed)


def tiny_skyreels_i2v_pipeline(seed: int = 0) -> HunyuanSkyreelsImageToVideoPipeline:
    """A HunyuanSkyreelsImageToVideoPipeline (SkyReels-V1 I2V): the HunyuanVideo components with a transformer taking
    the image latents as input channels and no guidance embedding."""
    return _build(lambda: HunyuanSkyreelsImageToVideoPipeline(**_hunyuan_components(image_to_video=True)), seed)


def _hunyuan_video15_components(image_to_video: bool = False, meanflow: bool = False) -> dict:
    """HunyuanVideo 1.5's components: the Qwen2.5-VL text model read three layers from the top, a ByT5 encoder for
    quoted (glyph) text, the HunyuanVideo 1.5 VAE (4× spatial compression here: 8×8 latents at 32×32; the real one's
    16× would leave 2×2), a transformer taking the noisy latents with condition latents and a mask channel, a
    ``ClassifierFreeGuidance`` guider (6, as the checkpoints ship), the 480p checkpoints' FlowMatchEuler shift 5; with
    ``image_to_video``, SigLIP (its PIL image processor; 16 tokens of 32² images here, 729 of 384² in the real one);
    with ``meanflow``, the step-distilled checkpoints' second (end-time) timestep embedder."""
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    # Trained on the pipeline's chat-templated system message, so that its words are single tokens, and reloaded (as
    # from_pretrained does, with Qwen2's own pre-tokenizer): the prefix is then the real tokenizer's 108 tokens, the
    # crop the pipeline applies, and what remains is the prompt's own tokens.
    template = jinja2.Template(_QWEN3_CHAT_TEMPLATE)
    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "a"}]
    with tempfile.TemporaryDirectory() as folder:
        _qwen_tokenizer(template.render(messages=messages, add_generation_prompt=True)).save_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,  # the pipeline reads hidden_states[-3]
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    byt5 = ByT5Tokenizer()
    latent_channels = 4
    components = {
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": HunyuanVideo15Transformer3DModel(
            in_channels=2 * latent_channels + 1,  # noisy latents, condition latents, condition mask
            out_channels=latent_channels,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=2,
            num_refiner_layers=1,
            text_embed_dim=32,
            text_embed_2_dim=32,
            image_embed_dim=16,
            rope_axes_dim=(4, 6, 6),
            target_size=TINY_RESOLUTION,
            task_type="i2v" if image_to_video else "t2v",
            use_meanflow=meanflow,
        ),
        "vae": AutoencoderKLHunyuanVideo15(
            block_out_channels=(8, 16, 16),
            layers_per_block=1,
            latent_channels=latent_channels,
            spatial_compression_ratio=4,
            temporal_compression_ratio=4,
        ),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
        "text_encoder_2": _t5_encoder(byt5, d_model=32),  # a ByT5 encoder reads bytes: its vocabulary is 384
        "tokenizer_2": byt5,
        "guider": ClassifierFreeGuidance(guidance_scale=6.0),
    }
    if image_to_video:
        components["image_encoder"] = SiglipVisionModel(
            SiglipVisionConfig(
                hidden_size=16,  # the transformer's image_embed_dim (1152 in the real one)
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=TINY_RESOLUTION,
                patch_size=8,
            )
        )
        components["feature_extractor"] = SiglipImageProcessor(
            size={"height": TINY_RESOLUTION, "width": TINY_RESOLUTION}
        )
    return components


def tiny_hunyuan_video15_pipeline(seed: int = 0) -> HunyuanVideo15Pipeline:
    """A HunyuanVideo15Pipeline (HunyuanVideo 1.5 text-to-video; see :func:`_hunyuan_video15_components`)."""
    return _build(lambda: HunyuanVideo15Pipeline(**_hunyuan_video15_components()), seed)


def tiny_hunyuan_video15_i2v_pipeline(seed: int = 0, meanflow: bool = False) -> HunyuanVideo15ImageToVideoPipeline:
    """A HunyuanVideo15ImageToVideoPipeline (HunyuanVideo 1.5 image-to-video: the first frame's latents and a mask as
    condition channels, SigLIP embeddings of the image in the sequence); ``meanflow``: a MeanFlow (step-distilled)
    transformer."""
    return _build(lambda: HunyuanVideo15ImageToVideoPipeline(**_hunyuan_video15_components(True, meanflow)), seed)
