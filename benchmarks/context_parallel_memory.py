"""Per-GPU memory of a GRPO training step on Wan 2.2 A14B (one 14B expert trained) at 480x832 and 81 frames, against
the context-parallel size: computed from the architecture (not measured; `benchmarks/matrix.py gpu` measures when a GPU
is lent).

    python benchmarks/context_parallel_memory.py [--frames 81] [--height 480] [--width 832] [--lora_r 64]

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


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--lora_r", type=int, default=64)
    args = parser.parse_args(argv)
    rows = table(args.frames, args.height, args.width, args.lora_r)
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
