"""The registry of tiny pipelines, saving them to folders, and the synthetic datasets and prompts built from them."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
from diffusers import (
    DiffusionPipeline,
    ModularPipeline,
)

from ..tiny_folders import MODULAR_INDEX, TINY_SAMPLING, TINY_SAMPLING_FILE
from .components import _PREFERENCE_PROMPTS, TINY_RESOLUTION, TINY_VIDEO_FRAMES
from .flux import tiny_flux2_klein_pipeline, tiny_flux2_pipeline, tiny_flux_kontext_pipeline, tiny_flux_pipeline
from .hunyuan_video import (
    tiny_hunyuan_video15_i2v_pipeline,
    tiny_hunyuan_video15_pipeline,
    tiny_hunyuan_video_pipeline,
    tiny_skyreels_i2v_pipeline,
)
from .ltx2 import tiny_ltx2_condition_pipeline, tiny_ltx2_i2v_pipeline, tiny_ltx2_pipeline
from .minimax_h3 import MINIMAX_H3_TINY_FRAMES, tiny_minimax_h3_pipeline
from .qwen_image import (
    tiny_qwen_image21_pipeline,
    tiny_qwen_image_edit_pipeline,
    tiny_qwen_image_edit_plus_pipeline,
    tiny_qwen_image_pipeline,
)
from .stable_diffusion import tiny_sd2_pipeline, tiny_sd3_pipeline, tiny_sd_pipeline, tiny_sdxl_pipeline
from .wan import (
    tiny_wan22_5b_i2v_pipeline,
    tiny_wan22_5b_pipeline,
    tiny_wan22_i2v_pipeline,
    tiny_wan22_pipeline,
    tiny_wan_flf2v_pipeline,
    tiny_wan_i2v_pipeline,
    tiny_wan_pipeline,
)
from .z_image import tiny_z_image_pipeline


def tiny_condition_images(count: int, seed: int = 0) -> list:
    """``count`` distinct 32×32 PIL images (smooth random colour gradients) for image-to-video datasets."""
    from ..visualization import to_pil

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
    "ltx2-i2v": tiny_ltx2_i2v_pipeline,
    "ltx2-condition": tiny_ltx2_condition_pipeline,
    "minimax-h3": tiny_minimax_h3_pipeline,
    "skyreels-i2v": tiny_skyreels_i2v_pipeline,
    "wan-i2v": tiny_wan_i2v_pipeline,
    "wan-flf2v": tiny_wan_flf2v_pipeline,
    "wan22": tiny_wan22_pipeline,
    "wan22-i2v": tiny_wan22_i2v_pipeline,
    "wan22-5b": tiny_wan22_5b_pipeline,
    "wan22-5b-i2v": tiny_wan22_5b_i2v_pipeline,
}


def save_tiny_pipeline(kind: str, directory: str, seed: int = 0) -> str:
    """Build the tiny pipeline ``kind`` (one of ``TINY_PIPELINES``) and ``save_pretrained`` it to
    ``directory``, with its sampling settings in ``TINY_SAMPLING_FILE``."""
    if kind not in TINY_PIPELINES:
        raise ValueError(f"unknown tiny pipeline {kind!r}; choose from {sorted(TINY_PIPELINES)}")
    pipeline = TINY_PIPELINES[kind](seed)
    processor = pipeline.components.get("processor")
    modular = isinstance(pipeline, ModularPipeline)
    if processor is None:
        pipeline.save_pretrained(directory)
    else:  # transformers cannot save a processor without its video processor: its parts, then the index entry
        if modular:
            pipeline.update_components(processor=None)
        else:
            pipeline.register_modules(processor=None)
        pipeline.save_pretrained(directory)
        processor.image_processor.save_pretrained(os.path.join(directory, "processor"))
        processor.tokenizer.save_pretrained(os.path.join(directory, "processor"))
        index_path = os.path.join(directory, MODULAR_INDEX if modular else "model_index.json")
        with open(index_path) as handle:
            index = json.load(handle)
        entry = ["transformers", type(processor).__name__]
        if modular:  # (a modular index also says where each component loads from)
            entry.append(
                {**index["processor"][2], "pretrained_model_name_or_path": directory, "subfolder": "processor"}
            )
        with open(index_path, "w") as handle:
            json.dump({**index, "processor": entry}, handle, indent=2)
    with open(os.path.join(directory, TINY_SAMPLING_FILE), "w") as handle:
        frames = MINIMAX_H3_TINY_FRAMES if kind == "minimax-h3" else TINY_VIDEO_FRAMES
        video = {"num_frames": frames} if getattr(pipeline, "video_processor", None) is not None else {}
        json.dump({"kind": kind, **TINY_SAMPLING, **video}, handle)
    return directory


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

    from ..visualization import to_pil

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
