"""A tiny MiniMax-H3 audio-video modular pipeline."""

from __future__ import annotations

from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3ModularPipeline,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
)
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Blocks
from transformers import Qwen3VLProcessor

from ..tiny_folders import qwen_vl_processor
from .components import _build, _qwen3_vl, _qwen_tokenizer

MINIMAX_H3_TINY_FRAMES = 124
"""The tiny MiniMax-H3's frame count: the pipeline's shortest clip (5 s at 24 fps, 17·7 + 5 frames), 37 latent frames
and 207 audio latents per channel."""


def tiny_minimax_h3_pipeline(seed: int = 0) -> MiniMaxH3ModularPipeline:
    """A MiniMaxH3ModularPipeline with the released classes at toy sizes: the transformer (2 blocks, one token
    refiner, the (1, 2, 2) patch), the two schedulers at their released shifts (video 12, audio 3), the video VAE
    (16× spatial, 17 → 5 frames per chunk, tiled, per-channel statistics; 4 latent channels), the mono audio VAE
    (40 latents a second as released, at 3.2 kHz instead of 32; 4 latent channels) and a Qwen3-VL conditioner of 51 layers (the pipeline reads
    ``hidden_states[50]``), with its processor. 32×32 canvases (one 2×2 group of latents a frame)."""

    def factory() -> MiniMaxH3ModularPipeline:
        tokenizer = _qwen_tokenizer()
        text_encoder = _qwen3_vl(tokenizer, width=16, layers=51, heads=2)  # (the pipeline reads layer 50)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)
        pipeline = MiniMaxH3Blocks().init_pipeline()
        pipeline.update_components(
            transformer=MiniMaxH3Transformer3DModel(
                num_attention_heads=2,
                attention_head_dim=16,
                hidden_size=24,
                num_layers=2,
                num_refiner_layers=1,
                ffn_dim=32,
                in_channels=4,
                audio_in_channels=4,
                text_dim=16,
                freq_dim=32,
                time_embed_hidden_dim=32,
                time_embed_dim=16,
                rope_freq_dim=2,
            ),
            scheduler=MiniMaxH3Scheduler(shift=12.0),
            audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
            vae=AutoencoderKLMiniMaxH3(
                latent_channels=4,
                block_out_channels=(8, 8, 8, 8, 8, 8),
                layers_per_block=1,
                norm_num_groups=4,
                decoder_num_layers=1,
                decoder_num_attention_heads=2,
                decoder_attention_head_dim=8,
                decoder_num_register_tokens=1,
                decoder_ffn_mult=2,
                latents_mean=(0.1, 0.2, -0.1, 0.0),
                latents_std=(1.5, 0.8, 1.2, 1.0),
            ),
            audio_vae=AutoencoderKLMiniMaxH3Audio(
                # 40 latents a second as released, at a tenth of its rate: a hop of 80 samples at 3.2 kHz (the
                # pipeline's shortest clip, 5 s, is 165,600 samples a channel at 32 kHz: most of a tiny round's time)
                encoder_dim=4,
                encoder_rates=(2, 5, 8),
                latent_dim=16,
                latent_channels=4,
                num_attention_heads=2,
                decoder_dim=16,
                decoder_rates=(10, 8),
                decoder_kernel_sizes=(20, 16),
                sampling_rate=3200,
                resblock_kernel_sizes=(3,),
                resblock_dilation_sizes=((1, 3),),
                latents_mean=[0.1, 0.0, -0.1, 0.2],
                latents_std=[1.1, 0.9, 1.0, 1.2],
            ),
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            processor=qwen_vl_processor(tokenizer, image_processor, Qwen3VLProcessor),
        )
        return pipeline

    return _build(factory, seed)
