"""``python -m trl_dance.text_task build DIR`` / ``evaluate MODEL [--lora DIR]``: see the package docstring."""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads sleep on shared cores

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    from .model import SAMPLING, SFT_STEPS, TEXT_MODEL_DIR, VAE_STEPS, build_text_model

    parser = argparse.ArgumentParser(prog="python -m trl_dance.text_task", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="train the text model from scratch and save it")
    build.add_argument("output")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--vae_steps", type=int, default=VAE_STEPS)
    build.add_argument("--sft_steps", type=int, default=SFT_STEPS)
    build.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it)")
    build.add_argument(
        "--snapshot_steps", type=int, default=0, help="also save the pipeline every this many SFT steps"
    )
    build.add_argument(
        "--work_dir", default=None, help="the VAE and snapshots (default OUTPUT.build; a VAE there is reused)"
    )
    evaluate = commands.add_parser("evaluate", help="held-out accuracy of a model (and a LoRA) by both engines")
    evaluate.add_argument("model", nargs="?", default=None, help="a pipeline folder (default: the shipped model)")
    evaluate.add_argument("--lora", default=None, help="a folder with pytorch_lora_weights.safetensors")
    evaluate.add_argument("--split", choices=("held_out", "train"), default="held_out")
    evaluate.add_argument("--num_words", type=int, default=200)
    evaluate.add_argument("--samples_per_word", type=int, default=2)
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--engines", nargs="+", default=["rapidocr", "easyocr"])
    evaluate.add_argument("--grid", default=None, help="write a PNG grid of the first 32 words' first samples")
    args = parser.parse_args(argv)
    torch.set_num_threads(getattr(args, "threads", torch.get_num_threads()))

    if args.command == "build":
        build_text_model(args.output, args.seed, args.vae_steps, args.sft_steps, args.work_dir, args.snapshot_steps)
        return {}
    from diffusers import StableDiffusion3Pipeline

    from .evaluation import judge_images, pipeline_generator, sample_words, within_prompt_diversity
    from .words import word_split

    pipeline = StableDiffusion3Pipeline.from_pretrained(args.model or TEXT_MODEL_DIR)
    pipeline.set_progress_bar_config(disable=True)
    if args.lora:
        pipeline.load_lora_weights(args.lora)
    train, held_out = word_split()
    words = (held_out if args.split == "held_out" else train)[: args.num_words]
    images = sample_words(pipeline_generator(pipeline, **SAMPLING), words, args.samples_per_word, args.seed)
    targets = [word for word in words for _ in range(args.samples_per_word)]
    result = judge_images(images.flatten(0, 1), targets, args.engines)
    if args.samples_per_word > 1:
        result["diversity"] = within_prompt_diversity(images)
    if args.grid:
        from ..visualization import save_image_grid

        first = images[:32, 0]
        save_image_grid([first[i : i + 8] for i in range(0, len(first), 8)], args.grid, size=128)
    print(json.dumps({k: round(v, 4) for k, v in result.items()}, indent=1))
    return result


if __name__ == "__main__":
    main()
