"""What the reward's backward pass keeps of the VAE decode, with and without decoder checkpointing.

    python benchmarks/direct_reward_memory.py

Counts the bytes of the tensors autograd saves for backward (distinct storages) while decoding latents with gradients:
measured on the tiny FLUX pipeline (real tensors), and computed on FLUX.1's published VAE configuration at 1024² in
bf16 on the meta device (shapes only: no weights, no memory).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from diffusers import AutoencoderKL

from trl_dance.random_weights import MODEL_CONFIGS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_dance.testing import save_tiny_pipeline  # noqa: E402


def saved_for_backward(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd saves while running ``fn(*inputs)``."""
    sizes: dict[object, int] = {}

    def pack(tensor):
        meta = tensor.device.type == "meta"
        key = id(tensor) if meta else tensor.untyped_storage().data_ptr()
        sizes[key] = tensor.numel() * tensor.element_size() if meta else tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*inputs)
    return sum(sizes.values())


def measure(vae, latents) -> dict[str, int]:
    decode = lambda z: vae.decode(z, return_dict=False)[0]  # noqa: E731
    vae.disable_gradient_checkpointing()
    plain = saved_for_backward(decode, latents)
    vae.enable_gradient_checkpointing()
    checkpointed = saved_for_backward(decode, latents)
    vae.disable_gradient_checkpointing()
    return {"without": plain, "with": checkpointed}


def main() -> None:
    from diffusers import DiffusionPipeline

    with tempfile.TemporaryDirectory() as folder:
        vae = DiffusionPipeline.from_pretrained(save_tiny_pipeline("flux", folder)).vae
    channels = vae.config.latent_channels
    tiny = measure(vae, torch.randn(1, channels, 4, 4, requires_grad=True))  # 32×32 images
    with torch.device("meta"):
        flux_vae = AutoencoderKL.from_config(AutoencoderKL.load_config(os.path.join(MODEL_CONFIGS, "flux-dev", "vae")))
        flux_vae = flux_vae.to(torch.bfloat16)
    flux = measure(flux_vae, torch.randn(1, 16, 128, 128, device="meta", dtype=torch.bfloat16, requires_grad=True))
    print("VAE decode, bytes saved for backward per image (without → with decoder checkpointing):")
    print(f"  tiny FLUX, 32² fp32 (measured): {tiny['without'] / 2**20:.2f} MiB → {tiny['with'] / 2**20:.2f} MiB "
          f"({tiny['without'] / tiny['with']:.1f}×)")  # fmt: skip
    print(f"  FLUX.1 VAE, 1024² bf16 (computed): {flux['without'] / 2**30:.2f} GiB → {flux['with'] / 2**30:.2f} GiB "
          f"({flux['without'] / flux['with']:.1f}×)")  # fmt: skip


if __name__ == "__main__":
    main()
