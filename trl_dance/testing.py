"""Tiny, random-weight diffusers pipelines built fully offline, for tests, demos and CPU benchmarks.

Each builder returns a real diffusers pipeline in float32 on CPU, in eval mode, deterministic for a given seed,
with tokenizers built in memory. Saved with ``save_pretrained`` they load back through the ordinary
``<Pipeline>.from_pretrained(path)``, the path users take with Hub ids::

    python -m trl_dance.testing flux ./tiny-flux        # writes a FluxPipeline folder
    python -m trl_dance.testing wan-i2v ./tiny-wan-i2v --image-prompts ./i2v-prompts   # + prompts with images

Images are 32×32 and Wan videos 5 frames of 32×32 (the VAEs downsample by 2); one 8-step generation takes a fraction
of a second on one core.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import string
import tempfile
from collections.abc import Callable

import jinja2
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    AutoencoderKLQwenImage,
    AutoencoderKLQwenImage21,
    AutoencoderKLWan,
    DDIMScheduler,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    HunyuanSkyreelsImageToVideoPipeline,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
    PNDMScheduler,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import (
    AutoTokenizer,
    ByT5Tokenizer,
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    CLIPVisionConfig,
    CLIPVisionModel,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    GemmaTokenizer,
    LlamaConfig,
    LlamaModel,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2TokenizerFast,
    Qwen2VLProcessor,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

TINY_RESOLUTION = 32
_CHARS = string.ascii_lowercase + string.digits + ".,!?'-"
_CLIP_DIM = 32
# SD's 0.18215 (SDXL's 0.13025) gives its trained VAE unit-variance latents; on these random VAEs it would shrink the
# latents to std ~0.04, ten times below the flow pipelines', and drown image differences in the noise. 1.5 puts
# every tiny pipeline's scaled latents at std ~0.4.
_UNET_VAE_SCALING = 1.5


def _clip_tokenizer() -> CLIPTokenizer:
    # Character-level BPE (no merges): every prompt tokenizes without any downloaded vocabulary.
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in _CHARS:
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    return CLIPTokenizer(
        vocab=vocab,
        merges=[],
        model_max_length=77,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def _t5_tokenizer() -> T5Tokenizer:
    chars = _CHARS + string.ascii_uppercase
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


def tiny_z_image_pipeline(seed: int = 0) -> ZImagePipeline:
    """A ZImagePipeline (Z-Image / Z-Image-Turbo: a Qwen3 text encoder read at its second-to-last layer, FLUX.1's
    16-channel-style VAE with its published scaling and shift, a single-stream DiT with noise and context refiners,
    FlowMatchEuler with the static shift 3 the checkpoints ship), 32×32 images."""

    def factory():
        tokenizer = _qwen3_tokenizer()
        text_encoder = _qwen3(Qwen3Model, tokenizer, layers=2)  # the pipeline reads the second-to-last
        return ZImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
            vae=_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=ZImageTransformer2DModel(
                all_patch_size=(2,),
                all_f_patch_size=(1,),
                in_channels=4,
                dim=32,
                n_layers=2,
                n_refiner_layers=1,
                n_heads=2,
                n_kv_heads=2,
                cap_feat_dim=32,
                axes_dims=[4, 6, 6],  # sums to the head dimension, as Z-Image's (32, 48, 48) to 128
                axes_lens=[1536, 512, 512],
            ),
        )

    return _build(factory, seed)


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


def wan_scheduler() -> UniPCMultistepScheduler:
    """Wan 2.1's published scheduler configuration (UniPC on flow sigmas, shift 3 for 480p)."""
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )


TINY_VIDEO_FRAMES = 5


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


def _wan_components(image_to_video: bool = False, two_experts: bool = False, expand_timesteps: bool = False) -> dict:
    """The components of a tiny Wan pipeline: a VAE (:func:`_wan_vae`) downsampling frames by 2, 4 latent channels. For
    image-to-video the transformer also takes the 2-channel frame mask and the image latents, and attends to a
    tiny CLIP vision encoder's features (Wan 2.1; Wan 2.2 A14B has no image encoder). ``two_experts``: Wan 2.2
    A14B's layout; ``expand_timesteps``: Wan 2.2 TI2V-5B's (one timestep per token, the image's latent as the first
    latent frame)."""
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


# Qwen-Image's prompt template: its encoder drops the first 34 tokens, the system prefix as the real tokenizer splits it.
_QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
# Qwen-Image-Edit's system prompt (Edit-Plus adds "Picture 1: " before each source image).
_QWEN_IMAGE_EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


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


def _qwen2_vl_processor(
    tokenizer: Qwen2TokenizerFast, image_processor=None, cls: type = Qwen2VLProcessor
) -> Qwen2VLProcessor | Qwen3VLProcessor:
    """Qwen-Image-Edit's ``Qwen2VLProcessor`` (Qwen-Image 2.1's ``Qwen3VLProcessor`` with ``cls``): Qwen2-VL's image
    processor with its shipped settings (patch 14, merge 2, CLIP statistics; the PIL backend: the default one needs
    torchvision, which CPU-only torch lacks) and ``tokenizer`` (and its chat template). transformers 5.24 type-checks
    even an absent video processor against a class that needs torchvision, so that check is skipped for it
    (``video_processor=None``)."""
    from unittest import mock

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def check_present(self, name, argument):
        return None if argument is None else check(self, name, argument)

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", check_present):
        return cls(
            image_processor=image_processor or Qwen2VLImageProcessorPil(),
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=tokenizer.chat_template,
        )


def _qwen_image_edit(cls: type, seed: int, zero_cond_t: bool) -> DiffusionPipeline:
    """A Qwen-Image-Edit pipeline of class ``cls``: Qwen-Image's components and Qwen2-VL's processor, whose images the
    text encoder's vision tower reads with the instruction."""

    def factory():
        components = _qwen_image_components(zero_cond_t=zero_cond_t, editing=True)
        return cls(**components, processor=_qwen2_vl_processor(components["tokenizer"]))

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
        ids = tokenizer.convert_tokens_to_ids
        text_encoder = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(
                text_config={
                    "vocab_size": len(tokenizer),
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "head_dim": 8,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
                },
                vision_config={
                    "depth": 1,
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_heads": 2,
                    "out_hidden_size": 32,
                    "patch_size": 16,  # one merged vision token per 32×32 pixels: a 2×2 group of 16× latents
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
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)
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
            processor=_qwen2_vl_processor(tokenizer, image_processor, Qwen3VLProcessor),
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


def _hunyuan_video15_components(image_to_video: bool = False) -> dict:
    """HunyuanVideo 1.5's components: the Qwen2.5-VL text model read three layers from the top, a ByT5 encoder for
    quoted (glyph) text, the HunyuanVideo 1.5 VAE (4× spatial compression here: 8×8 latents at 32×32; the real one's
    16× would leave 2×2), a transformer taking the noisy latents with condition latents and a mask channel, a
    ``ClassifierFreeGuidance`` guider (6, as the checkpoints ship), the 480p checkpoints' FlowMatchEuler shift 5; with
    ``image_to_video``, SigLIP (its PIL image processor; 16 tokens of 32² images here, 729 of 384² in the real one)."""
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


def tiny_hunyuan_video15_i2v_pipeline(seed: int = 0) -> HunyuanVideo15ImageToVideoPipeline:
    """A HunyuanVideo15ImageToVideoPipeline (HunyuanVideo 1.5 image-to-video: the first frame's latents and a mask as
    condition channels, SigLIP embeddings of the image in the sequence)."""
    return _build(lambda: HunyuanVideo15ImageToVideoPipeline(**_hunyuan_video15_components(True)), seed)


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


def ltx2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """LTX-2's published scheduler configuration (exponential shift for the video's token count, terminal σ 0.1)."""
    return FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )


LTX2_TINY_REGISTERS = 8
"""Learnable registers of the tiny LTX-2 connectors (128 in the real ones): ``max_sequence_length`` must divide by it."""


def tiny_ltx2_pipeline(seed: int = 0) -> LTX2Pipeline:
    """An LTX2Pipeline (LTX-2.3's architecture: gated attention, cross-attention modulation, perturbed attention for
    STG, per-modality text projections and learnable registers in the connectors): Gemma 3, a 2× video VAE (5 frames
    of 32² → 3 × 16 × 16 latents), an audio VAE and vocoder; the video's 0.2 s of audio are 5 latent frames."""

    def factory() -> LTX2Pipeline:
        tokenizer = _gemma_tokenizer()
        text_encoder = _gemma3(tokenizer)
        hidden = text_encoder.config.text_config.hidden_size
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4,
            output_channels=2,
            ch_mult=(1,),
            num_res_blocks=1,
            attn_resolutions=None,
            in_channels=2,
            resolution=32,
            latent_channels=2,
            norm_type="pixel",
            causality_axis="height",
            dropout=0.0,
            mid_block_add_attention=False,
            sample_rate=16000,
            mel_hop_length=160,
            is_causal=True,
            mel_bins=8,
        )
        vae = AutoencoderKLLTX2Video(
            latent_channels=4,
            block_out_channels=(8,),
            decoder_block_out_channels=(8,),
            layers_per_block=(1,),
            decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False),
            downsample_type=("spatial",),
            upsample_residual=(False,),
            upsample_factor=(1,),
            timestep_conditioning=False,
            patch_size=1,
            patch_size_t=1,
        )
        vae.use_framewise_encoding = vae.use_framewise_decoding = False
        # Per-channel latent statistics as the real VAEs ship them (the defaults 0 and 1 would leave the pipeline's
        # (de)normalisation untested); spreads above 1 also let the random decoder's brightness follow the latents.
        with torch.no_grad():
            vae.latents_mean.copy_(torch.tensor([0.2, -0.3, 0.1, 0.4]))
            vae.latents_std.copy_(torch.tensor([2.0, 2.8, 1.6, 2.4]))
            audio_vae.latents_mean.copy_(torch.tensor([0.1, -0.1, 0.2, 0.0]))
            audio_vae.latents_std.copy_(torch.tensor([1.5, 2.0, 1.2, 1.8]))
        return LTX2Pipeline(
            scheduler=ltx2_scheduler(),
            vae=vae,
            audio_vae=audio_vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            connectors=LTX2TextConnectors(
                caption_channels=hidden,
                text_proj_in_factor=text_encoder.config.text_config.num_hidden_layers + 1,
                video_connector_num_attention_heads=2,
                video_connector_attention_head_dim=8,
                video_connector_num_layers=1,
                video_connector_num_learnable_registers=LTX2_TINY_REGISTERS,
                video_gated_attn=True,
                audio_connector_num_attention_heads=2,
                audio_connector_attention_head_dim=4,
                audio_connector_num_layers=1,
                audio_connector_num_learnable_registers=LTX2_TINY_REGISTERS,
                audio_gated_attn=True,
                connector_rope_base_seq_len=32,
                rope_type="split",
                per_modality_projections=True,
                video_hidden_dim=16,
                audio_hidden_dim=8,
                proj_bias=True,
            ),
            transformer=LTX2VideoTransformer3DModel(
                in_channels=4,
                out_channels=4,
                num_attention_heads=2,
                attention_head_dim=8,
                cross_attention_dim=16,
                gated_attn=True,
                cross_attn_mod=True,
                audio_in_channels=4,  # latent channels × latent mel bins
                audio_out_channels=4,
                audio_num_attention_heads=2,
                audio_attention_head_dim=4,
                audio_cross_attention_dim=8,
                audio_gated_attn=True,
                audio_cross_attn_mod=True,
                num_layers=2,
                caption_channels=hidden,
                rope_type="split",
                use_prompt_embeddings=False,
                perturbed_attn=True,
            ),
            vocoder=LTX2Vocoder(
                in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins,
                hidden_channels=32,
                out_channels=2,
                upsample_kernel_sizes=[4, 4],
                upsample_factors=[2, 2],
                resnet_kernel_sizes=[3],
                resnet_dilations=[[1, 3, 5]],
                leaky_relu_negative_slope=0.1,
                output_sampling_rate=24000,  # the real vocoder's (the tiny one's 4× upsampling only pretends to)
            ),
        )

    return _build(factory, seed)


def tiny_condition_images(count: int, seed: int = 0) -> list:
    """``count`` distinct 32×32 PIL images (smooth random colour gradients) for image-to-video datasets."""
    from .visualization import to_pil

    generator = torch.Generator().manual_seed(seed)
    corners = torch.rand(count, 3, 2, 2, generator=generator)
    images = torch.nn.functional.interpolate(corners, size=(TINY_RESOLUTION, TINY_RESOLUTION), mode="bilinear")
    return to_pil(images)


_IMAGE_KINDS = ("flux", "sd3", "sd", "sd2", "sdxl", "qwen-image", "qwen-image21")
TINY_PIPELINES: dict[str, Callable[[int], DiffusionPipeline]] = {
    "flux": tiny_flux_pipeline,
    "flux-kontext": tiny_flux_kontext_pipeline,
    "flux2": tiny_flux2_pipeline,
    "flux2-klein": tiny_flux2_klein_pipeline,
    "sd3": tiny_sd3_pipeline,
    "z-image": tiny_z_image_pipeline,
    "sd": tiny_sd_pipeline,
    "sd2": tiny_sd2_pipeline,
    "sdxl": tiny_sdxl_pipeline,
    "qwen-image": tiny_qwen_image_pipeline,
    "qwen-image-edit": tiny_qwen_image_edit_pipeline,
    "qwen-image-edit-plus": tiny_qwen_image_edit_plus_pipeline,
    "qwen-image21": tiny_qwen_image21_pipeline,
    "wan": tiny_wan_pipeline,
    "hunyuan-video": tiny_hunyuan_video_pipeline,
    "hunyuan-video15": tiny_hunyuan_video15_pipeline,
    "hunyuan-video15-i2v": tiny_hunyuan_video15_i2v_pipeline,
    "ltx2": tiny_ltx2_pipeline,
    "skyreels-i2v": tiny_skyreels_i2v_pipeline,
    "wan-i2v": tiny_wan_i2v_pipeline,
    "wan22": tiny_wan22_pipeline,
    "wan22-i2v": tiny_wan22_i2v_pipeline,
    "wan22-5b": tiny_wan22_5b_pipeline,
    "wan22-5b-i2v": tiny_wan22_5b_i2v_pipeline,
}


# Written beside a tiny pipeline's model_index.json: the sampling settings its recipes use, which `trl-dance eval`
# takes as defaults (the pipelines' own defaults, e.g. FLUX's 1024² × 28 steps, take minutes on such a model).
TINY_SAMPLING_FILE = "trl_dance_tiny.json"
TINY_SAMPLING = {"height": TINY_RESOLUTION, "width": TINY_RESOLUTION, "num_inference_steps": 8}


def save_tiny_pipeline(kind: str, directory: str, seed: int = 0) -> str:
    """Build the tiny pipeline ``kind`` (one of ``TINY_PIPELINES``) and ``save_pretrained`` it to
    ``directory``, with its sampling settings in ``TINY_SAMPLING_FILE``."""
    if kind not in TINY_PIPELINES:
        raise ValueError(f"unknown tiny pipeline {kind!r}; choose from {sorted(TINY_PIPELINES)}")
    pipeline = TINY_PIPELINES[kind](seed)
    processor = pipeline.components.get("processor")
    if processor is None:
        pipeline.save_pretrained(directory)
    else:  # transformers cannot save a processor without its video processor: its parts, then the index entry
        pipeline.register_modules(processor=None)
        pipeline.save_pretrained(directory)
        processor.image_processor.save_pretrained(os.path.join(directory, "processor"))
        processor.tokenizer.save_pretrained(os.path.join(directory, "processor"))
        index_path = os.path.join(directory, "model_index.json")
        with open(index_path) as handle:
            index = json.load(handle)
        with open(index_path, "w") as handle:
            json.dump({**index, "processor": ["transformers", type(processor).__name__]}, handle, indent=2)
    with open(os.path.join(directory, TINY_SAMPLING_FILE), "w") as handle:
        json.dump({"kind": kind, **TINY_SAMPLING}, handle)
    return directory


def load_tiny_pipeline(directory: str, **kwargs) -> DiffusionPipeline:
    """``DiffusionPipeline.from_pretrained(directory)`` of a saved tiny pipeline. A Qwen-Image-Edit or Qwen-Image 2.1
    folder's processor is built from its saved parts and handed in: transformers loads a ``Qwen2VLProcessor`` /
    ``Qwen3VLProcessor`` only with torchvision (its video processor), which CPU-only torch lacks; with torchvision,
    ``from_pretrained`` alone loads it. ``kwargs`` go to ``from_pretrained``."""
    folder = os.path.join(directory, "processor")
    if not os.path.isdir(folder):
        return DiffusionPipeline.from_pretrained(directory, **kwargs)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with open(os.path.join(directory, "model_index.json")) as handle:
        cls = {"Qwen3VLProcessor": Qwen3VLProcessor}.get(json.load(handle)["processor"][1], Qwen2VLProcessor)
    processor = _qwen2_vl_processor(
        AutoTokenizer.from_pretrained(folder), Qwen2VLImageProcessorPil.from_pretrained(folder), cls
    )
    return DiffusionPipeline.from_pretrained(directory, processor=processor, **kwargs)


def tiny_preference_dataset(
    kind: str,
    count: int = 32,
    offset: float = 0.2,
    seed: int = 0,
    color: tuple[float, float, float] = (1, 1, 1),
    num_frames: int = TINY_VIDEO_FRAMES,
):
    """Synthetic preference pairs from the tiny pipeline's own samples: the image shifted by ``+offset · color`` (RGB)
    is chosen over its twin shifted by ``−offset · color``: brighter over darker by default, redder over cyan with
    ``color=(1, -1, -1)``. A ``datasets.Dataset`` with ``prompt``, ``chosen``, ``rejected``: PIL images, or for the
    text-to-video kinds (``"wan"``) lists of ``num_frames`` PIL frames, every frame shifted alike."""
    from datasets import Dataset

    from .visualization import to_pil

    if kind not in (*_IMAGE_KINDS, "wan"):
        raise ValueError(f"preference pairs: choose kind from {(*_IMAGE_KINDS, 'wan')}, got {kind!r}")
    prompts = [_PREFERENCE_PROMPTS[i % len(_PREFERENCE_PROMPTS)] for i in range(count)]
    extra = {"max_sequence_length": 32} if kind in ("flux", "wan") else {}
    if kind == "wan":
        extra["num_frames"] = num_frames
    if kind != "qwen-image21":  # (its pipeline has no guidance_scale: true_cfg_scale, 1 by default)
        extra["guidance_scale"] = 1.0
    with torch.no_grad():
        output = TINY_PIPELINES[kind](seed)(
            prompts,
            num_inference_steps=6,
            height=TINY_RESOLUTION,
            width=TINY_RESOLUTION,
            output_type="pt",
            generator=torch.Generator().manual_seed(seed),
            **extra,
        )
    media = output.frames if kind == "wan" else output.images[:, :3]  # (B, F, 3, H, W) or (B, 3, H, W): RGB of RGBA
    shift = offset * torch.tensor(color, dtype=media.dtype).view(3, 1, 1)

    def pil(values: torch.Tensor):
        if values.ndim == 4:
            return to_pil(values)
        return [to_pil(video) for video in values]

    return Dataset.from_dict(
        {
            "prompt": prompts,
            "chosen": pil((media + shift).clamp(0, 1)),
            "rejected": pil((media - shift).clamp(0, 1)),
        }
    )


def save_image_prompts(directory: str, seed: int = 0) -> str:
    """Write ``directory/prompts.jsonl``, one ``{"prompt", "image"}`` row per prompt with the path of a PNG from
    :func:`tiny_condition_images`: the layout users give image-to-video GRPO (``prompts_file``). Returns its path."""
    os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    rows = []
    for i, (prompt, image) in enumerate(
        zip(_PREFERENCE_PROMPTS, tiny_condition_images(len(_PREFERENCE_PROMPTS), seed))
    ):
        path = os.path.join(directory, "images", f"{i}.png")
        image.save(path)
        rows.append({"prompt": prompt, "image": path})
    path = os.path.join(directory, "prompts.jsonl")
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    return path


_PREFERENCE_PROMPTS = ["a cat", "a dog", "a red house", "blue sky", "green tree", "old car", "big ship", "sun set"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="trl-dance tiny", description="Save a tiny random-weight diffusers pipeline to a folder."
    )
    parser.add_argument("kind", choices=sorted(TINY_PIPELINES))
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--preferences", metavar="DIR", help="also save synthetic preference pairs (save_to_disk) for Diffusion-DPO"
    )
    parser.add_argument(
        "--image-prompts",
        metavar="DIR",
        help="also write DIR/prompts.jsonl (prompt, image path) and its PNGs, for image-to-video GRPO",
    )
    args = parser.parse_args(argv)
    print(save_tiny_pipeline(args.kind, args.directory, args.seed))
    if args.preferences:
        tiny_preference_dataset(args.kind, seed=args.seed).save_to_disk(args.preferences)
        print(args.preferences)
    if args.image_prompts:
        print(save_image_prompts(args.image_prompts, seed=args.seed))


if __name__ == "__main__":
    main()
