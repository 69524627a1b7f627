"""Real-size pipelines with random weights, built from the published configurations shipped in
``trl_dance/model_configs/`` (each a diffusers pipeline folder without weights or tokenizer files), so that speed and
memory are measured at full size with nothing downloaded.

Prompts go through the tiny offline tokenizers of :mod:`trl_dance.testing.components` (only the sequence length, not the
vocabulary, matches the real model's); every network has the real checkpoint's classes and shapes.
"""

from __future__ import annotations

import json
import os

import diffusers
import torch
import transformers
from diffusers import DiffusionPipeline
from transformers import ByT5Tokenizer

MODEL_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs")

_DEPTHS = (
    "num_layers",
    "num_single_layers",
    "num_hidden_layers",
    "depth",
    "n_layers",
)  # the stacks ``layers`` shrinks


def random_weight_models() -> list[str]:
    """The names of the shipped configurations (``flux-dev``, ``wan21-14b``, ``qwen-image``, ...)."""
    return sorted(os.listdir(MODEL_CONFIGS))


def _tokenizer(class_name: str):
    from .testing import components as testing

    for prefix, build in (
        ("CLIP", testing._clip_tokenizer),
        ("T5", testing._t5_tokenizer),
        ("ByT5", lambda: ByT5Tokenizer()),  # byte-level: no vocabulary file
        ("Qwen2", testing._qwen3_tokenizer),  # with Qwen3's chat template, which Z-Image applies
        ("Llama", testing._llama_tokenizer),
        ("Gemma", testing._gemma_tokenizer),
    ):
        if class_name.startswith(prefix):
            return build()
    raise ValueError(f"no offline tokenizer stands in for {class_name}")


def _shrunk(config: dict, layers: int | None) -> dict:
    """``config`` with every stack depth (and those of nested text/vision configs) set to ``layers``."""
    if layers is None:
        return config
    config = {key: _shrunk(value, layers) if isinstance(value, dict) else value for key, value in config.items()}
    shrunk = {key: layers if key in _DEPTHS and isinstance(value, int) else value for key, value in config.items()}
    if isinstance(shrunk.get("layer_types"), list):  # one entry per layer (Qwen2.5-VL's text model checks it)
        shrunk["layer_types"] = shrunk["layer_types"][:layers]
    return shrunk


def random_weight_pipeline(name: str, layers: int | None = None) -> DiffusionPipeline:
    """The pipeline ``name`` (one of :func:`random_weight_models`, or a folder of the same layout) with random
    weights, built on the current default device and dtype (``with torch.device("cuda")`` and
    ``torch.set_default_dtype(torch.bfloat16)`` build a 12B model in seconds without a host copy). ``layers``
    shrinks every transformer stack to that depth, and text-encoder stacks to at least 3 (smoke tests)."""
    folder = name if os.path.isdir(name) else os.path.join(MODEL_CONFIGS, name)
    if not os.path.isdir(folder):
        raise ValueError(f"unknown model {name!r}; shipped: {random_weight_models()}")
    with open(os.path.join(folder, "model_index.json")) as handle:
        index = json.load(handle)
    # A conditioner read at a middle layer keeps the layers up to it (MiniMax-H3: hidden_states[50] of a 64-layer
    # Qwen3-VL, whose last 13 never reach the transformer and would not fit beside it on one GPU).
    text_layers = index.get("_text_encoder_layers")
    components = {}
    for key, value in index.items():
        if key.startswith("_"):
            continue
        if not isinstance(value, list):  # a pipeline setting (Wan 2.2's boundary_ratio)
            components[key] = value
            continue
        library, class_name = value
        if class_name is None:
            components[key] = None
        elif class_name.endswith("Processor"):  # (a modular pipeline's: built from the tokenizer below)
            continue
        elif key.startswith("tokenizer"):
            components[key] = _tokenizer(class_name)
        elif library == "diffusers" or hasattr(diffusers.pipelines, library):
            # (a pipeline's own modules, e.g. LTX-2's connectors and vocoder, are indexed under its module's name)
            cls = getattr(diffusers if library == "diffusers" else getattr(diffusers.pipelines, library), class_name)
            config = cls.load_config(os.path.join(folder, key))
            if issubclass(cls, torch.nn.Module):
                components[key] = cls.from_config(_shrunk(config, layers))
            else:  # a scheduler: its tables on the host, whatever the default device
                with torch.device("cpu"):
                    components[key] = cls.from_config(config)
        else:
            cls = getattr(transformers, class_name)
            with open(os.path.join(folder, key, "config.json")) as handle:
                # Text encoders keep 3 layers: pipelines read hidden states 2 or 3 from the end (Z-Image,
                # HunyuanVideo 1.5); FLUX.2's fixed depths 10/20/30 still need its full stack.
                config = _shrunk(json.load(handle), None if layers is None else max(layers, 3))
            if key.startswith("text_encoder") and text_layers is not None:
                config = _shrunk(config, text_layers)
            components[key] = cls(cls.config_class.from_dict(config))
    pipeline_class = getattr(diffusers, index["_class_name"])
    if not issubclass(pipeline_class, diffusers.ModularPipeline):
        return pipeline_class(**components)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .tiny_folders import qwen_vl_processor

    if "processor" in index:  # Qwen3-VL's processor: its image settings, the offline tokenizer
        image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)
        processor_class = getattr(transformers, index["processor"][1])
        components["processor"] = qwen_vl_processor(components["tokenizer"], image_processor, processor_class)
    pipeline = getattr(diffusers, index["_blocks_class_name"])().init_pipeline()
    pipeline.update_components(**components)
    return pipeline
