"""Benchmark models: the tiny offline pipelines, and real architectures (FLUX.1-dev, SD3.5-medium, Wan 2.1 1.3B and
14B, Wan 2.2 A14B, HunyuanVideo, Qwen-Image, Z-Image-Turbo, HunyuanVideo 1.5, FLUX.2 [klein] base 4B, LTX-2,
MiniMax-H3) built with random weights from the published configurations shipped in ``trl_dance/model_configs`` (no
download; see :mod:`trl_dance.random_weights`)."""

from __future__ import annotations

import torch
from peft import LoraConfig

from trl_dance.policies import QwenImageEditPolicy
from trl_dance.random_weights import random_weight_models, random_weight_pipeline
from trl_dance.testing import TINY_RESOLUTION, load_tiny_pipeline, save_tiny_pipeline

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
    "tiny-flux2-klein": "flux2-klein",
    "tiny-z-image": "z-image",
    "tiny-hunyuan-video15": "hunyuan-video15",
    "tiny-qwen-image-edit": "qwen-image-edit",
    "tiny-qwen-image21": "qwen-image21",
    "tiny-hunyuan-video15-i2v": "hunyuan-video15-i2v",
    "tiny-ltx2": "ltx2",
    "tiny-ltx2-i2v": "ltx2-i2v",
    "tiny-wan-flf2v": "wan-flf2v",
    "tiny-minimax-h3": "minimax-h3",
}
MODELS = [*TINY, *random_weight_models()]
VIDEO_MODELS = (
    "tiny-wan",
    "tiny-hunyuan-video",
    "tiny-skyreels-i2v",
    "tiny-hunyuan-video15",
    "tiny-hunyuan-video15-i2v",
    "tiny-ltx2",
    "tiny-ltx2-i2v",
    "tiny-wan-flf2v",
    "tiny-minimax-h3",
    "wan21-1.3b",
    "wan21-14b",
    "wan22-a14b",
    "hunyuan-video",
    "hunyuan-video15",
    "ltx2",
    "minimax-h3",
)
# Frame counts other than the scripts' defaults (5 tiny, 33 real): MiniMax-H3's shortest clip is 124 frames (5 s).
DEFAULT_FRAMES = {"tiny-minimax-h3": 124, "minimax-h3": 124}
# Config values a model needs: MiniMax-H3 samples on its pipeline's two σ grids (and without guidance: its rows pass
# --guidance-scale 1).
CONFIG_OVERRIDES = {name: {"sigma_schedule": "pipeline"} for name in DEFAULT_FRAMES}
# Rows carry an `image` column (and, first-last-frame, a `last_image`).
IMAGE_CONDITIONED_MODELS = (
    "tiny-flux-kontext",
    "tiny-skyreels-i2v",
    "tiny-qwen-image-edit",
    "tiny-hunyuan-video15-i2v",
    "tiny-ltx2-i2v",
    "tiny-wan-flf2v",
)
LAST_FRAME_MODELS = ("tiny-wan-flf2v",)
# Sampling arguments a model needs here: LTX-2 I2V's H.264 re-compression of its image needs PyAV.
PIPELINE_KWARGS = {"tiny-ltx2-i2v": {"image_crf": 0}}


def build_model(name: str, workdir: str, layers: int | None = None):
    """A pipeline folder (tiny models, loaded through ``from_pretrained``) or a pipeline instance (real sizes, in
    bf16 on the GPU when there is one: saving 12B random parameters would only measure the disk)."""
    if name in TINY:
        folder = save_tiny_pipeline(TINY[name], f"{workdir}/{name}")
        if name == "tiny-qwen-image-edit":
            # Its pipeline's 1024² sources would be 65k tokens on the tiny VAE: sources at the tiny output size; and
            # its processor loads without torchvision only through load_tiny_pipeline.
            QwenImageEditPolicy.source_image_area = TINY_RESOLUTION**2
            return load_tiny_pipeline(folder)
        return folder
    cuda = torch.cuda.is_available()
    default_dtype = torch.get_default_dtype()
    # Built directly on the GPU in bf16: FLUX plus T5-XXL in float32 would not fit beside each other.
    torch.set_default_dtype(torch.bfloat16 if cuda else torch.float32)
    try:
        with torch.device("cuda" if cuda else "cpu"):
            return random_weight_pipeline(name, layers)
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
    if trainer.flops is not None:
        trainer.flops.remove()
    denoiser = trainer.policy.denoiser
    if getattr(denoiser, "peft_config", None):
        denoiser.delete_adapters(list(denoiser.peft_config))
    trainer.optimizer = trainer.lr_scheduler = None
    trainer.accelerator.free_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
