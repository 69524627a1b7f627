"""Benchmark models: the tiny offline pipelines, and FLUX.1-dev / SD3.5-medium / Wan 2.1 T2V 1.3B built from their
published configurations with random weights (no download; prompts use the tiny character-level tokenizers, so only the
sequence length, not the vocabulary, matches the real models)."""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from peft import LoraConfig
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from trl_dance.testing import _clip_tokenizer, _t5_tokenizer, flux_scheduler, save_tiny_pipeline, wan_scheduler

TINY = {
    "tiny-flux": "flux",
    "tiny-sd3": "sd3",
    "tiny-sd": "sd",
    "tiny-sdxl": "sdxl",
    "tiny-wan": "wan",
    "tiny-qwen-image": "qwen-image",
    "tiny-hunyuan-video": "hunyuan-video",
    "tiny-flux-kontext": "flux-kontext",
    "tiny-skyreels-i2v": "skyreels-i2v",
}
MODELS = [*TINY, "flux-dev", "sd35-medium", "wan21-1.3b"]
VIDEO_MODELS = ("tiny-wan", "tiny-hunyuan-video", "tiny-skyreels-i2v", "wan21-1.3b")
IMAGE_CONDITIONED_MODELS = ("tiny-flux-kontext", "tiny-skyreels-i2v")  # rows carry an `image` column


def _vae(scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    # The 16-channel VAE of FLUX.1 and SD3.x (identical architecture, different latent statistics).
    return AutoencoderKL(
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[128, 256, 512, 512],
        layers_per_block=2,
        latent_channels=16,
        norm_num_groups=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _clip(hidden: int, layers: int, heads: int, ff: int, act: str, projection: bool, vocab: int):
    config = CLIPTextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=77,
        projection_dim=hidden,
        hidden_act=act,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5_xxl(layers: int, umt5: bool = False) -> T5EncoderModel | UMT5EncoderModel:
    """T5-XXL's encoder (FLUX, SD3), or UMT5-XXL's (Wan: same widths, a 256k vocabulary)."""
    config = (UMT5Config if umt5 else T5Config)(
        vocab_size=256384 if umt5 else 32128,
        d_model=4096,
        d_kv=64,
        d_ff=10240,
        num_layers=layers,
        num_heads=64,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
    )
    return (UMT5EncoderModel if umt5 else T5EncoderModel)(config)


def flux_dev_pipeline(layers: int | None = None) -> FluxPipeline:
    """FLUX.1-dev (19 double + 38 single blocks, width 3072, guidance embedding), CLIP-L, T5-XXL, 16-channel VAE.
    ``layers`` shrinks every stack (smoke tests on a CPU)."""
    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    return FluxPipeline(
        scheduler=flux_scheduler(),
        vae=_vae(0.3611, 0.1159),
        text_encoder=_clip(768, layers or 12, 12, 3072, "quick_gelu", False, 49408),
        tokenizer=tokenizer,
        text_encoder_2=_t5_xxl(layers or 24),
        tokenizer_2=tokenizer_2,
        transformer=FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=layers or 19,
            num_single_layers=2 * layers if layers else 38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
    )


def sd35_medium_pipeline(layers: int | None = None) -> StableDiffusion3Pipeline:
    """SD3.5-medium (MMDiT-X: 24 blocks, width 1536, dual attention in the first 13, QK RMS-norm), CLIP-L, CLIP-G,
    T5-XXL, 16-channel VAE."""
    depth = layers or 24
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(1.5305, 0.0609),
        text_encoder=_clip(768, layers or 12, 12, 3072, "quick_gelu", True, 49408),
        tokenizer=_clip_tokenizer(),
        text_encoder_2=_clip(1280, layers or 32, 20, 5120, "gelu", True, 49408),
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5_xxl(layers or 24),
        tokenizer_3=_t5_tokenizer(),
        transformer=SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=depth,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(min(13, depth))),
            qk_norm="rms_norm",
        ),
    )


def wan21_1_3b_pipeline(layers: int | None = None) -> WanPipeline:
    """Wan 2.1 T2V 1.3B (30 blocks, width 1536, 12 heads), UMT5-XXL, the Wan VAE (8× space, 4× time)."""
    return WanPipeline(
        tokenizer=_t5_tokenizer(),
        text_encoder=_t5_xxl(layers or 24, umt5=True),
        vae=AutoencoderKLWan(),  # its defaults are Wan 2.1's published configuration
        transformer=WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=8960,
            num_layers=layers or 30,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
        ),
        scheduler=wan_scheduler(),
    )


REAL = {"flux-dev": flux_dev_pipeline, "sd35-medium": sd35_medium_pipeline, "wan21-1.3b": wan21_1_3b_pipeline}


def build_model(name: str, workdir: str, layers: int | None = None):
    """A pipeline folder (tiny models, loaded through ``from_pretrained``) or a pipeline instance (real sizes, in
    bf16 on the GPU when there is one: saving 12B random parameters would only measure the disk)."""
    if name in TINY:
        return save_tiny_pipeline(TINY[name], f"{workdir}/{name}")
    cuda = torch.cuda.is_available()
    default_dtype = torch.get_default_dtype()
    # Built directly on the GPU in bf16: FLUX plus T5-XXL in float32 would not fit beside each other.
    torch.set_default_dtype(torch.bfloat16 if cuda else torch.float32)
    try:
        with torch.device("cuda" if cuda else "cpu"):
            return REAL[name](layers)
    finally:
        torch.set_default_dtype(default_dtype)


def lora_config(rank: int) -> LoraConfig | None:
    """DanceGRPO's LoRA (attention projections, alpha = r) for every family; rank 0: full fine-tune (None)."""
    if not rank:
        return None
    return LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"])


def release(trainer) -> None:
    """Give back what a benchmark's trainer holds, so that the next run starts from the same pipeline instance: its
    LoRA adapter deleted (a real architecture is built once, not reloaded, between runs), the optimizer and the
    accelerator's references freed."""
    denoiser = trainer.policy.denoiser
    if getattr(denoiser, "peft_config", None):
        denoiser.delete_adapters(list(denoiser.peft_config))
    trainer.optimizer = trainer.lr_scheduler = None
    trainer.accelerator.free_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
