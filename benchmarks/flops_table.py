"""Closed-form denoiser FLOPs of the real architectures at the sizes users train (computed on the meta device from the
shipped configurations: nothing is allocated or run; see trl_dance/flops.py).

    python benchmarks/flops_table.py            # markdown tables: TFLOPs of one forward per sample, and its split;
                                                # the masked-text families with their padding and with it trimmed

One forward per sample without CFG (CFG doubles it); a full fine-tuning step costs ≈ 3 forwards (the backward computes
the weight and the input gradients), a LoRA step ≈ 2 (frozen weights get no gradient), activation checkpointing one
more. The last line printed is JSON.
"""

from __future__ import annotations

import json

import torch

from trl_dance.flops import SAMPLE, denoiser_ops
from trl_dance.policies import policy_class
from trl_dance.random_weights import random_weight_pipeline

# (model, label, image/video tokens per sample, text tokens): 16× spatial compression (VAE 8 × patch 2); video
# frames compress 4× in time (1 + (F − 1)/4 latent frames).
IMAGE = [(512, "512²", 32 * 32), (1024, "1024²", 64 * 64)]
VIDEO = [(33, "480×832×33", 9 * 30 * 52), (81, "480×832×81", 21 * 30 * 52)]
MODELS = {
    "flux-dev": (IMAGE, 512),
    "sd35-medium": (IMAGE, 77 + 256),  # CLIP's 77 tokens then T5's 256
    "qwen-image": (IMAGE, 512),
    "wan21-1.3b": (VIDEO, 512),
    "wan21-14b": (VIDEO, 512),  # each expert of Wan 2.2 A14B is this network
    "hunyuan-video": (VIDEO, 256),
}


def _ops(name: str) -> tuple[list, float]:
    """The denoiser operations of the shipped configuration ``name`` (built on the meta device) and its parameters
    in billions."""
    with torch.device("meta"):
        pipeline = random_weight_pipeline(name)
    ops = denoiser_ops(pipeline.transformer, policy_class(pipeline).flop_layout)
    return ops, sum(p.numel() for p in pipeline.transformer.parameters()) / 1e9


def table() -> tuple[str, list[dict]]:
    rows, records = [], []
    for name, (sizes, text) in MODELS.items():
        ops, params = _ops(name)
        for _, label, image in sizes:
            tokens = {"image": image, "text": text, SAMPLE: 1}
            linear = sum(op.flops(tokens, 1) for op in ops if op.kind != "attention") / 1e12
            attention = sum(op.flops(tokens, 1) for op in ops if op.kind == "attention") / 1e12
            records.append(
                {"model": name, "size": label, "tokens": image + text, "forward_tflops": linear + attention}
            )
            rows.append(
                f"| {name} ({params:.1f}B) | {label} | {image:,} + {text} | {linear + attention:.1f} | "
                f"{100 * attention / (linear + attention):.0f} % |"
            )
    head = (
        "| model | size | tokens (video/image + text) | TFLOPs per forward | attention share |\n|---|---|---|---|---|"
    )
    return "\n".join([head, *rows]), records


# Masked-text families (DiffusionPolicy.padded_text): the pipelines' padded lengths against a 64-token prompt (a
# trimmed batch's length: its longest prompt rounded up to 8; DanceGRPO's and Flow-GRPO's prompt sets average 20-40
# tokens), no quoted text for HunyuanVideo 1.5's ByT5 stream. (model, size label, image tokens, padded, trimmed).
TRIMMED = [
    ("qwen-image", "1024²", 64 * 64, {"text": 512}, {"text": 64}),
    ("hunyuan-video", "480×832×33", 9 * 30 * 52, {"text": 256}, {"text": 64}),
    (
        "hunyuan-video15", "480×832×33", 9 * 30 * 52,
        {"mllm": 1000, "byt5": 256, "text": 1256}, {"mllm": 64, "byt5": 0, "text": 64},
    ),
]  # fmt: skip


def trimmed_text_table() -> tuple[str, list[dict]]:
    rows, records = [], []
    for name, label, image, padded, trimmed in TRIMMED:
        ops, _ = _ops(name)
        flops = [
            sum(op.flops({"image": image, "vision": 0, SAMPLE: 1, **text}, 1) for op in ops) / 1e12
            for text in (padded, trimmed)
        ]
        records.append({"model": name, "size": label, "padded_tflops": flops[0], "trimmed_tflops": flops[1]})
        rows.append(
            f"| {name} | {label} | {image:,} + {padded['text']} → {trimmed['text']} | {flops[0]:.1f} → {flops[1]:.1f} | "
            f"{flops[1] / flops[0]:.2f}× |"
        )
    head = "| model | size | tokens (padded → trimmed text) | TFLOPs per forward | ratio |\n|---|---|---|---|---|"
    return "\n".join([head, *rows]), records


if __name__ == "__main__":
    text, records = table()
    trimmed, trimmed_records = trimmed_text_table()
    print(text + "\n\n" + trimmed)
    print(json.dumps(records + trimmed_records))
