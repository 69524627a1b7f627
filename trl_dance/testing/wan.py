"""Tiny Wan 2.1 / 2.2 text- and image-to-video pipelines (one and two experts, TI2V-5B)."""

from __future__ import annotations

from diffusers import (
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    CLIPVisionModel,
)

from .components import _CLIP_DIM, TINY_RESOLUTION, _build, _t5_encoder, _t5_tokenizer


def wan_scheduler() -> UniPCMultistepScheduler:
    """Wan 2.1's published scheduler configuration (UniPC on flow sigmas, shift 3 for 480p)."""
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )


def _wan_vae(latent_channels: int, temporal: int, wan22: bool) -> AutoencoderKLWan:
    """A tiny causal 3D VAE downsampling frames by ``temporal``. Wan 2.1 layout: pixels by 2. Wan 2.2 layout (TI2V-5B):
    residual blocks behind a 2×2 pixel patchify, pixels by 8."""
    layout = (
        {"dim_mult": [1, 2, 2], "temperal_downsample": [False, True], "is_residual": True, "patch_size": 2}
        | {"in_channels": 12, "out_channels": 12, "decoder_base_dim": 8, "scale_factor_spatial": 8}
        if wan22
        else {"dim_mult": [1, 2], "temperal_downsample": [True], "scale_factor_spatial": 2}
    )
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=latent_channels,
        num_res_blocks=1,
        latents_mean=[0.1, -0.1, 0.05, -0.05],
        latents_std=[1.2, 0.8, 1.0, 1.1],
        scale_factor_temporal=temporal,
        **layout,
    )


def _wan_components(
    image_to_video: bool = False, two_experts: bool = False, expand_timesteps: bool = False, last_frame: bool = False
) -> dict:
    """The components of a tiny Wan pipeline: a VAE (:func:`_wan_vae`) downsampling frames by 2, 4 latent channels. For
    image-to-video the transformer also takes the 2-channel frame mask and the image latents, and attends to a
    tiny CLIP vision encoder's features (Wan 2.1; Wan 2.2 A14B has no image encoder). ``two_experts``: Wan 2.2
    A14B's layout; ``expand_timesteps``: Wan 2.2 TI2V-5B's (one timestep per token, the image's latent as the first
    latent frame); ``last_frame``: Wan 2.1 FLF2V's (the first and last frames' CLIP features side by side, with
    learned positions)."""
    tokenizer = _t5_tokenizer()
    latent_channels, temporal = 4, 2
    concat_image = image_to_video and not expand_timesteps
    clip_features = concat_image and not two_experts

    def transformer():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=2 * latent_channels + temporal if concat_image else latent_channels,
            out_channels=latent_channels,
            text_dim=32,
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=32,
            image_dim=_CLIP_DIM if clip_features else None,
            added_kv_proj_dim=24 if clip_features else None,  # the attention width, 2 heads of 12
            # FLF2V: positions for both images' CLIP tokens (2 × 257 in the real model; 2 × (16 patches + class)).
            pos_embed_seq_len=2 * ((TINY_RESOLUTION // 8) ** 2 + 1) if last_frame else None,
        )

    components = {
        "tokenizer": tokenizer,
        "text_encoder": _t5_encoder(tokenizer, d_model=32, umt5=True),
        "vae": _wan_vae(latent_channels, temporal, wan22=expand_timesteps),
        "transformer": transformer(),
        "scheduler": wan_scheduler(),
    }
    if two_experts:
        # Wan 2.2 A14B: a second transformer (other weights) for the low-noise steps, its published boundary.
        components["transformer_2"], components["boundary_ratio"] = transformer(), 0.875
    if expand_timesteps:
        components["expand_timesteps"] = True
    if clip_features:
        components["image_encoder"] = CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=_CLIP_DIM,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=TINY_RESOLUTION,
                patch_size=8,
                projection_dim=_CLIP_DIM,
                attention_dropout=0.0,
                dropout=0.0,
            )
        )
        components["image_processor"] = CLIPImageProcessor(
            size={"shortest_edge": TINY_RESOLUTION}, crop_size={"height": TINY_RESOLUTION, "width": TINY_RESOLUTION}
        )
    return components


def tiny_wan_pipeline(seed: int = 0) -> WanPipeline:
    """A WanPipeline (3D transformer, UMT5 text encoder, causal 3D VAE): videos of ``TINY_VIDEO_FRAMES`` (or any
    1 + 2k) frames of 32×32."""
    return _build(lambda: WanPipeline(**_wan_components()), seed)


def tiny_wan22_pipeline(seed: int = 0) -> WanPipeline:
    """A two-expert WanPipeline (Wan 2.2 A14B layout): ``transformer`` for the steps with timestep >= 875,
    ``transformer_2`` for the others."""
    return _build(lambda: WanPipeline(**_wan_components(two_experts=True)), seed)


def tiny_wan_i2v_pipeline(seed: int = 0) -> WanImageToVideoPipeline:
    """A WanImageToVideoPipeline (Wan 2.1 I2V layout: image latents and frame mask as extra input channels, CLIP
    vision features in an image cross-attention): videos of 32×32 that start from a given image."""
    return _build(lambda: WanImageToVideoPipeline(**_wan_components(image_to_video=True)), seed)


def tiny_wan_flf2v_pipeline(seed: int = 0) -> WanImageToVideoPipeline:
    """A WanImageToVideoPipeline in the Wan 2.1 FLF2V layout: videos of 32×32 from a given first and last frame (the
    pipeline's ``image`` and ``last_image``), both images' CLIP features in the image cross-attention."""
    return _build(lambda: WanImageToVideoPipeline(**_wan_components(image_to_video=True, last_frame=True)), seed)


def tiny_wan22_i2v_pipeline(seed: int = 0) -> WanImageToVideoPipeline:
    """A two-expert WanImageToVideoPipeline (Wan 2.2 I2V A14B layout): image latents and frame mask as extra input
    channels, no CLIP image features."""
    return _build(lambda: WanImageToVideoPipeline(**_wan_components(image_to_video=True, two_experts=True)), seed)


def tiny_wan22_5b_pipeline(seed: int = 0) -> WanPipeline:
    """A WanPipeline in the Wan 2.2 TI2V-5B layout used for text-to-video: one timestep per latent token, a residual
    VAE behind a pixel patchify (32×32 pixels: 4×4 latents, 2×2 tokens per latent frame)."""
    return _build(lambda: WanPipeline(**_wan_components(expand_timesteps=True)), seed)


def tiny_wan22_5b_i2v_pipeline(seed: int = 0) -> WanImageToVideoPipeline:
    """A WanImageToVideoPipeline in the Wan 2.2 TI2V-5B layout: the image's latent is the first latent frame (timestep
    0 on its tokens), no extra input channels, no CLIP features."""
    return _build(lambda: WanImageToVideoPipeline(**_wan_components(image_to_video=True, expand_timesteps=True)), seed)
