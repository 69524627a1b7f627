"""Per-GPU memory of a GRPO training step on Wan 2.2 A14B (one 14B expert trained) at 480x832 and 81 frames, against
the context-parallel size: computed from the architecture, and with ``--measure`` measured on one GPU.

    python benchmarks/context_parallel_memory.py [--frames 81] [--height 480] [--width 832] [--lora_r 64]
    python benchmarks/context_parallel_memory.py --measure [--sizes 1 2 4 8] [--no-checkpointing-sizes 8]

``--measure`` builds the real 14B expert with random weights (bf16, LoRA in float32 as the trainers cast it, AdamW)
and runs one training forward and backward with CFG's two branches on the tokens one rank of a context-parallel group
of size C holds (the latent's height and width cut so that the grid has 1/C of the tokens): under Ulysses a rank keeps
1/C of the tokens outside attention and all tokens of 1/C of the heads inside it, the same number of elements, so this
is the per-rank memory without the all-to-all buffers (a few block-sized transients). It prints one JSON line per size:
peak allocated GB, its parts, and the step's seconds (a rank's time only at C = 1: the cut grid's attention is
1/C² of the whole's, a Ulysses rank's 1/C).

Model: Wan 14B (dim 5120, 40 blocks, 40 heads, FFN 13824, 512 text tokens), bf16 frozen weights; the trained
parameters in float32 with their gradient and Adam's two moments (16 bytes each); the frozen expert and text encoder
offloaded (recipes/configs/grpo_wan22_81f_cp.yaml). Activations of one training forward with CFG (two branches, as
the loss differentiates both): per block and video token, the tensors autograd keeps in bf16 (norm outputs, q/k/v/out
of self- and cross-attention with a flash/SDPA kernel that keeps no attention matrix, the FFN's input, hidden and
activation), Korthikanti et al.'s accounting extended to Wan's block; with activation checkpointing, each block's input
plus one block recomputed. Ulysses' all-to-all buffers and allocator fragmentation are not counted: keep ~10 % free.
"""

from __future__ import annotations

import argparse

GB = 1e9


def wan14b_tokens(frames: int, height: int, width: int) -> int:
    latent_frames = (frames - 1) // 4 + 1
    return latent_frames * (height // 16) * (width // 16)  # VAE 4x8x8, patch 1x2x2


def per_token_block_bytes(dim: int, ffn: int, text: int, tokens: int) -> float:
    """bf16 bytes autograd keeps per video token per block (the cross-attention's keys/values over the text are
    per-sample: spread over the tokens)."""
    self_attention = 2 * (dim + 3 * dim + dim + dim)  # norm out, q/k/v, attention output, out-projection input
    cross_attention = 2 * (dim + dim + dim) + 2 * 2 * text * dim / tokens  # norm, q, output; k/v of the text
    feed_forward = 2 * (dim + 2 * ffn)  # input, hidden before and after GELU
    modulation = 2 * 4 * dim  # AdaLN-style scale/shift products kept for backward
    return self_attention + cross_attention + feed_forward + modulation


def table(frames: int, height: int, width: int, lora_r: int) -> list[str]:
    dim, blocks, ffn, text, params = 5120, 40, 13824, 512, 14.0e9
    tokens = wan14b_tokens(frames, height, width)
    lora = blocks * 8 * lora_r * (dim + dim)  # q, k, v, out of self- and cross-attention
    rows = [
        f"Wan 2.2 A14B expert, {frames} frames at {height}x{width}: {tokens:,} video tokens per sample; "
        f"LoRA r {lora_r}: {lora / 1e6:.0f}M trained parameters",
        "",
        "| training | context parallel | frozen weights | trained state | activations (no checkpointing) | "
        "activations (checkpointing) | total with checkpointing |",
        "|---|---|---|---|---|---|---|",
    ]
    block = per_token_block_bytes(dim, ffn, text, tokens)
    for name, trained in (("LoRA", lora), ("full", params)):
        weights = 0.0 if name == "full" else 2 * params  # full fine-tuning: the float32 copy is the weights
        state = 16 * trained
        for size in (1, 2, 4, 8):
            local = 2 * tokens / size  # two CFG branches
            full = local * block * blocks
            checkpointed = local * 2 * dim * blocks + local * block  # block inputs + one block recomputed
            total = weights + state + checkpointed
            rows.append(
                f"| {name} | {size} | {weights / GB:.0f} GB | {state / GB:.1f} GB | {full / GB:.0f} GB | "
                f"{checkpointed / GB:.1f} GB | {total / GB:.0f} GB |"
            )
    return rows


# Latent (frames, height, width) grids of 81 frames at 480x832 cut to 1/C of its 32,760 tokens (patch 1x2x2).
_RANK_GRIDS = {1: (21, 60, 104), 2: (21, 30, 104), 4: (21, 30, 52), 8: (21, 30, 26)}


def measure(
    sizes: list[int], no_checkpointing: list[int], lora_r: int, layers: int | None, device: str = "cuda"
) -> list[dict]:
    """One forward and backward of the Wan 14B expert per context-parallel size on ``device`` (see the module
    docstring; on a CPU, a smoke test: memory reads 0); out-of-memory is recorded, not raised."""
    import json
    import os
    import time

    import torch
    from diffusers import WanTransformer3DModel
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    from trl_dance.random_weights import MODEL_CONFIGS

    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:  # as the trainers do (cudnn_attention=False): its kernel crashed FLUX's backward on an H200
        torch.backends.cuda.enable_cudnn_sdp(False)
    config = WanTransformer3DModel.load_config(os.path.join(MODEL_CONFIGS, "wan22-a14b", "transformer"))
    if layers:
        config["num_layers"] = layers
    torch.set_default_dtype(torch.bfloat16)
    with device:
        model = WanTransformer3DModel.from_config(config)
    torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=lora_r, lora_alpha=lora_r, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    cast_training_params(model, torch.float32)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-6)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / GB
    text = torch.randn(2, 512, config["text_dim"], device=device, dtype=torch.bfloat16)
    # A warm-up step on the smallest grid: Adam's state and the kernels' workspaces exist before any measurement.
    model.enable_gradient_checkpointing()
    warm = torch.randn(2, 16, *_RANK_GRIDS[8], device=device, dtype=torch.bfloat16)
    model(warm, torch.tensor([500.0, 500.0], device=device), text, return_dict=False)[0].float().mean().backward()
    optimizer.step()
    results = []
    for size in sizes:
        for checkpointing in (True, False) if size in no_checkpointing else (True,):
            if checkpointing:
                model.enable_gradient_checkpointing()
            else:
                model.disable_gradient_checkpointing()
            frames, height, width = _RANK_GRIDS[size]
            latents = torch.randn(2, 16, frames, height, width, device=device, dtype=torch.bfloat16)
            record = {"context_parallel": size, "checkpointing": checkpointing, "tokens_per_rank": frames * height * width // 4,
                      "layers": config["num_layers"], "lora_r": lora_r, "weights_gb": weights}  # fmt: skip
            try:
                optimizer.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated() / GB if cuda else 0.0
                start = time.perf_counter()
                out = model(latents, torch.tensor([500.0, 500.0], device=device), text, return_dict=False)[0]
                out.float().square().mean().backward()
                optimizer.step()
                if cuda:
                    torch.cuda.synchronize()
                record.update(step_s=time.perf_counter() - start, allocated_before_gb=before,
                              peak_gb=torch.cuda.max_memory_allocated() / GB if cuda else 0.0,
                              reserved_gb=torch.cuda.max_memory_reserved() / GB if cuda else 0.0)  # fmt: skip
                del out
            except torch.OutOfMemoryError:
                record["out_of_memory"] = True
            results.append(record)
            print(json.dumps(record), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--lora_r", type=int, default=64)
    parser.add_argument("--measure", action="store_true", help="measure on this GPU (see the module docstring)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8], choices=sorted(_RANK_GRIDS))
    parser.add_argument("--no-checkpointing-sizes", type=int, nargs="*", default=[8])
    parser.add_argument("--layers", type=int, default=None, help="fewer blocks (smoke tests)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.measure:
        measure(args.sizes, args.no_checkpointing_sizes, args.lora_r, args.layers, args.device)
        return []
    rows = table(args.frames, args.height, args.width, args.lora_r)
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
