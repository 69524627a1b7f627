"""Tiny FLUX.1, FLUX.1 Kontext, FLUX.2 and FLUX.2 [klein] pipelines."""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Qwen3ForCausalLM,
)

from .components import (
    _CLIP_DIM,
    _build,
    _clip_text_encoder,
    _clip_tokenizer,
    _qwen3,
    _qwen3_tokenizer,
    _qwen_tokenizer,
    _t5_encoder,
    _t5_tokenizer,
    _vae,
)


def flux_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """FLUX.1-dev's published scheduler configuration (resolution-dependent shift)."""
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def tiny_flux_pipeline(seed: int = 0) -> FluxPipeline:
    """A FluxPipeline (guidance-embedded transformer, CLIP + T5 text encoders, 4-channel VAE), 32×32 images."""

    def factory():
        tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
        return FluxPipeline(
            scheduler=flux_scheduler(),
            vae=_vae(latent_channels=4, scaling_factor=1.5035, shift_factor=0.0609),
            text_encoder=_clip_text_encoder(tokenizer),
            tokenizer=tokenizer,
            text_encoder_2=_t5_encoder(tokenizer_2, d_model=32),
            tokenizer_2=tokenizer_2,
            transformer=FluxTransformer2DModel(
                patch_size=1,
                in_channels=16,
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=32,
                pooled_projection_dim=_CLIP_DIM,
                guidance_embeds=True,
                axes_dims_rope=(4, 4, 8),
            ),
        )

    return _build(factory, seed)


def tiny_flux_kontext_pipeline(seed: int = 0) -> FluxKontextPipeline:
    """A FluxKontextPipeline (FLUX.1 Kontext, image editing): the tiny FLUX components; source images in the dataset's
    ``image`` column."""
    with torch.random.fork_rng(devices=[]):
        components = tiny_flux_pipeline(seed).components
    pipeline = FluxKontextPipeline(**{k: v for k, v in components.items() if v is not None})
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# Mistral's instruction format around FLUX.2's system message and prompt (text only, as the pipeline encodes prompts).
_MISTRAL_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ m['content'][0]['text'] }}"
    "[/SYSTEM_PROMPT]{% else %}[INST]{{ m['content'][0]['text'] }}[/INST]{% endif %}{% endfor %}"
)


def tiny_flux2_pipeline(seed: int = 0) -> Flux2Pipeline:
    """A Flux2Pipeline (FLUX.2: Mistral3 text encoder read at hidden layers 10, 20, 30, batch-norm-normalised
    patchified VAE latents, guidance-embedded transformer with 4-axis RoPE), 32×32 images.

    The pipeline's ``tokenizer`` is a tokenizer with a Mistral-style chat template, not the ``PixtralProcessor`` FLUX.2
    ships: transformers 5 builds that processor only with torchvision, which these CPU machines lack. The pipeline
    calls only ``apply_chat_template`` on text, which both provide.
    """

    def factory():
        tokenizer = _qwen_tokenizer()
        tokenizer.chat_template = _MISTRAL_CHAT_TEMPLATE
        text_encoder = Mistral3ForConditionalGeneration(
            Mistral3Config(
                text_config={
                    "model_type": "mistral",
                    "vocab_size": len(tokenizer),
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 30,  # the pipeline reads hidden states 10, 20 and 30
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "head_dim": 8,
                    "max_position_embeddings": 1024,
                },
                vision_config={
                    "model_type": "pixtral",
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "head_dim": 8,
                    "image_size": 28,
                    "patch_size": 14,
                },
                image_token_index=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            )
        )
        return Flux2Pipeline(
            scheduler=flux_scheduler(),
            vae=_flux2_vae(),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=_flux2_transformer(joint_attention_dim=3 * 32, guidance_embeds=True),
        )

    return _build(factory, seed)


def _flux2_vae() -> AutoencoderKLFlux2:
    """FLUX.2's VAE (2×2-patchified latents normalised by its batch-norm statistics), tiny."""
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        patch_size=(2, 2),
    )
    # Latent statistics as a trained VAE has them (a fresh one's are 0 and 1, which would hide their handling).
    vae.bn.running_mean.normal_(0.0, 0.5)
    vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def _flux2_transformer(joint_attention_dim: int, guidance_embeds: bool) -> Flux2Transformer2DModel:
    """FLUX.2's transformer (4-axis RoPE), one double- and one single-stream block."""
    return Flux2Transformer2DModel(
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=joint_attention_dim,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )


def tiny_flux2_klein_pipeline(seed: int = 0, is_distilled: bool = False) -> Flux2KleinPipeline:
    """A Flux2KleinPipeline (FLUX.2 [klein]: a Qwen3 text encoder read at hidden layers 9, 18 and 27, FLUX.2's VAE and
    transformer without a guidance embedding), 32×32 images. ``is_distilled=False`` is the base checkpoint (true CFG
    against the empty prompt, the one made for fine-tuning); ``True`` the step-distilled one (no CFG)."""

    def factory():
        tokenizer = _qwen3_tokenizer()
        text_encoder = _qwen3(Qwen3ForCausalLM, tokenizer, layers=27)  # the pipeline reads hidden states 9, 18, 27
        return Flux2KleinPipeline(
            scheduler=flux_scheduler(),
            vae=_flux2_vae(),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=_flux2_transformer(joint_attention_dim=3 * 32, guidance_embeds=False),
            is_distilled=is_distilled,
        )

    return _build(factory, seed)
