"""A tiny LTX-2 audio-video pipeline."""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2ConditionPipeline,
    LTX2ImageToVideoPipeline,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

from .components import _build, _gemma3, _gemma_tokenizer


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


def tiny_ltx2_pipeline(seed: int = 0, pipeline_class: type = LTX2Pipeline) -> LTX2Pipeline:
    """An LTX2Pipeline (LTX-2.3's architecture: gated attention, cross-attention modulation, perturbed attention for
    STG, per-modality text projections and learnable registers in the connectors): Gemma 3, a 2× video VAE (5 frames
    of 32² → 3 × 16 × 16 latents), an audio VAE and vocoder; the video's 0.2 s of audio are 5 latent frames.
    ``pipeline_class``: another pipeline of the same components (``LTX2ImageToVideoPipeline``)."""

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
        return pipeline_class(
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


def tiny_ltx2_i2v_pipeline(seed: int = 0) -> LTX2ImageToVideoPipeline:
    """An LTX2ImageToVideoPipeline of :func:`tiny_ltx2_pipeline`'s components: a given first frame."""
    return tiny_ltx2_pipeline(seed, LTX2ImageToVideoPipeline)


def tiny_ltx2_condition_pipeline(seed: int = 0) -> LTX2ConditionPipeline:
    """An LTX2ConditionPipeline of :func:`tiny_ltx2_pipeline`'s components: frame conditions (first frame, keyframes)."""
    return tiny_ltx2_pipeline(seed, LTX2ConditionPipeline)
