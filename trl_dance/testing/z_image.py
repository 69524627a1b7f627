"""A tiny Z-Image pipeline."""

from __future__ import annotations

from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import (
    Qwen3Model,
)

from .components import _build, _qwen3, _qwen3_tokenizer, _vae


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
