"""Tiny SD 1.5, SD 2.1 (v-prediction), SDXL and SD3 pipelines, with the schedulers they ship."""

from __future__ import annotations

from collections.abc import Callable

from diffusers import (
    DDIMScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)

from .components import (
    _CLIP_DIM,
    _UNET_VAE_SCALING,
    TINY_RESOLUTION,
    _build,
    _clip_text_encoder,
    _clip_tokenizer,
    _t5_encoder,
    _t5_tokenizer,
    _vae,
)

# The schedulers the real checkpoints ship, with their published configurations: the policies sample with DDIM built
# from these configs, and must not inherit anything else from them (SDXL's Euler scales initial noise by 14.6).
_SD_BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000}


def sd15_scheduler() -> PNDMScheduler:
    """Stable Diffusion 1.5's shipped scheduler: PNDM (PLMS), ε-prediction."""
    return PNDMScheduler(**_SD_BETAS, set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)


def sdxl_scheduler() -> EulerDiscreteScheduler:
    """SDXL 1.0 base's shipped scheduler: Euler with "leading" spacing, ε-prediction (initial noise σ_max ≈ 14.6)."""
    return EulerDiscreteScheduler(
        **_SD_BETAS,
        interpolation_type="linear",
        prediction_type="epsilon",
        steps_offset=1,
        timestep_spacing="leading",
        use_karras_sigmas=False,
    )


def sd21_scheduler() -> DDIMScheduler:
    """Stable Diffusion 2.1 (768)'s shipped scheduler: DDIM, v-prediction."""
    return DDIMScheduler(
        **_SD_BETAS, clip_sample=False, set_alpha_to_one=False, steps_offset=1, prediction_type="v_prediction"
    )


def tiny_sd3_pipeline(seed: int = 0) -> StableDiffusion3Pipeline:
    """A StableDiffusion3Pipeline (MMDiT, two CLIPs with projection + T5), 32×32 images."""

    def factory():
        tokenizer, tokenizer_2, tokenizer_3 = _clip_tokenizer(), _clip_tokenizer(), _t5_tokenizer()
        return StableDiffusion3Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=_vae(latent_channels=4, scaling_factor=1.5305, shift_factor=0.0609),
            text_encoder=_clip_text_encoder(tokenizer, with_projection=True),
            tokenizer=tokenizer,
            text_encoder_2=_clip_text_encoder(tokenizer_2, with_projection=True),
            tokenizer_2=tokenizer_2,
            text_encoder_3=_t5_encoder(tokenizer_3, d_model=2 * _CLIP_DIM),
            tokenizer_3=tokenizer_3,
            transformer=SD3Transformer2DModel(
                sample_size=TINY_RESOLUTION // 2,
                patch_size=2,
                in_channels=4,
                out_channels=4,
                num_layers=2,
                attention_head_dim=8,
                num_attention_heads=4,
                joint_attention_dim=2 * _CLIP_DIM,
                caption_projection_dim=32,
                pooled_projection_dim=2 * _CLIP_DIM,
                pos_embed_max_size=TINY_RESOLUTION // 2,
            ),
        )

    return _build(factory, seed)


def _unet(**kwargs) -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=TINY_RESOLUTION // 2,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=8,
        **kwargs,
    )


def _stable_diffusion(seed: int, scheduler: Callable, **unet) -> StableDiffusionPipeline:
    def factory():
        tokenizer = _clip_tokenizer()
        return StableDiffusionPipeline(
            vae=_vae(latent_channels=4, scaling_factor=_UNET_VAE_SCALING, shift_factor=None),
            text_encoder=_clip_text_encoder(tokenizer),
            tokenizer=tokenizer,
            unet=_unet(cross_attention_dim=_CLIP_DIM, **unet),
            scheduler=scheduler(),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    return _build(factory, seed)


def tiny_sd_pipeline(seed: int = 0) -> StableDiffusionPipeline:
    """A StableDiffusionPipeline (SD1.5 layout: UNet, one CLIP, SD1.5's PNDM scheduler), 32×32 images, no safety
    checker."""
    return _stable_diffusion(seed, sd15_scheduler)


def tiny_sd2_pipeline(seed: int = 0) -> StableDiffusionPipeline:
    """A StableDiffusionPipeline in the SD 2.1 (768) layout: v-prediction DDIM scheduler, linear attention projections
    and upcast attention in the UNet, 32×32 images."""
    return _stable_diffusion(seed, sd21_scheduler, use_linear_projection=True, upcast_attention=True)


def tiny_sdxl_pipeline(seed: int = 0) -> StableDiffusionXLPipeline:
    """A StableDiffusionXLPipeline (two CLIPs, pooled embeddings, ``add_time_ids``, SDXL's Euler scheduler), 32×32
    images."""

    def factory():
        tokenizer, tokenizer_2 = _clip_tokenizer(), _clip_tokenizer()
        addition_time_embed_dim = 8
        return StableDiffusionXLPipeline(
            vae=_vae(latent_channels=4, scaling_factor=_UNET_VAE_SCALING, shift_factor=None),
            text_encoder=_clip_text_encoder(tokenizer),
            text_encoder_2=_clip_text_encoder(tokenizer_2, with_projection=True),
            tokenizer=tokenizer,
            tokenizer_2=tokenizer_2,
            unet=_unet(
                cross_attention_dim=2 * _CLIP_DIM,
                addition_embed_type="text_time",
                addition_time_embed_dim=addition_time_embed_dim,
                projection_class_embeddings_input_dim=6 * addition_time_embed_dim + _CLIP_DIM,
            ),
            scheduler=sdxl_scheduler(),
        )

    return _build(factory, seed)
