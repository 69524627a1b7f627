"""Folders of tiny pipelines (:mod:`trl_dance.testing`) as production code meets them: how to recognise one and load
it. Kept apart from the builders so that loading a model never imports them."""

from __future__ import annotations

import json
import os
import warnings

import torch
from diffusers import DiffusionPipeline, ModularPipeline
from transformers import AutoTokenizer, Qwen2VLProcessor, Qwen3VLProcessor

# Written beside a tiny pipeline's model_index.json: the sampling settings its recipes use, which `trl-dance eval`
# takes as defaults (the pipelines' own defaults, e.g. FLUX's 1024² × 28 steps, take minutes on such a model).
TINY_SAMPLING_FILE = "trl_dance_tiny.json"
TINY_RESOLUTION = 32
"""Height and width of the tiny pipelines' images and videos."""
TINY_SAMPLING = {"height": TINY_RESOLUTION, "width": TINY_RESOLUTION, "num_inference_steps": 8}
MODULAR_INDEX = "modular_model_index.json"
"""The index a modular pipeline (MiniMax-H3) is saved with, instead of ``model_index.json``."""


def is_tiny_folder(folder: str) -> bool:
    """Whether ``folder`` holds a tiny pipeline saved by :func:`trl_dance.testing.save_tiny_pipeline`."""
    return os.path.isfile(os.path.join(folder, TINY_SAMPLING_FILE))


def qwen_vl_processor(
    tokenizer, image_processor=None, cls: type = Qwen2VLProcessor
) -> Qwen2VLProcessor | Qwen3VLProcessor:
    """Qwen-Image-Edit's ``Qwen2VLProcessor`` (Qwen-Image 2.1's ``Qwen3VLProcessor`` with ``cls``): Qwen2-VL's image
    processor with its shipped settings (patch 14, merge 2, CLIP statistics; the PIL backend: the default one needs
    torchvision, which CPU-only torch lacks) and ``tokenizer`` (and its chat template). transformers 5.24 type-checks
    even an absent video processor against a class that needs torchvision, so that check is skipped for it
    (``video_processor=None``)."""
    from unittest import mock

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def check_present(self, name, argument):
        return None if argument is None else check(self, name, argument)

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", check_present):
        return cls(
            image_processor=image_processor or Qwen2VLImageProcessorPil(),
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=tokenizer.chat_template,
        )


def load_tiny_pipeline(directory: str, **kwargs) -> DiffusionPipeline:
    """``DiffusionPipeline.from_pretrained(directory)`` of a saved tiny pipeline. A Qwen-Image-Edit or Qwen-Image 2.1
    folder's processor is built from its saved parts and handed in: transformers loads a ``Qwen2VLProcessor`` /
    ``Qwen3VLProcessor`` only with torchvision (its video processor), which CPU-only torch lacks; with torchvision,
    ``from_pretrained`` alone loads it. ``kwargs`` go to ``from_pretrained``."""
    folder = os.path.join(directory, "processor")
    modular = os.path.isfile(os.path.join(directory, MODULAR_INDEX))
    if not os.path.isdir(folder):
        return (
            load_modular_pipeline(directory, **kwargs)
            if modular
            else DiffusionPipeline.from_pretrained(directory, **kwargs)
        )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with open(os.path.join(directory, MODULAR_INDEX if modular else "model_index.json")) as handle:
        cls = {"Qwen3VLProcessor": Qwen3VLProcessor}.get(json.load(handle)["processor"][1], Qwen2VLProcessor)
    processor = qwen_vl_processor(
        AutoTokenizer.from_pretrained(folder), Qwen2VLImageProcessorPil.from_pretrained(folder), cls
    )
    if modular:
        return load_modular_pipeline(directory, processor=processor, **kwargs)
    return DiffusionPipeline.from_pretrained(directory, processor=processor, **kwargs)


TRAINED_WORKFLOWS = {"MiniMaxH3ModularPipeline": "t2va"}
"""The workflow a modular pipeline class is loaded for when none is named: the one its policy trains (MiniMax-H3's
repository holds two 61.7 GB transformer partitions; ``t2va`` loads only its own)."""


def load_modular_pipeline(model: str, workflow: str | None = None, **kwargs) -> ModularPipeline:
    """A modular pipeline (MiniMax-H3) from a Hub id or folder with its components loaded: ``ModularPipeline.
    from_pretrained`` pruned to ``workflow`` (default: :data:`TRAINED_WORKFLOWS`' entry for its class), then
    ``load_components`` with ``kwargs`` (``dtype``, ...); components given as modules in ``kwargs`` are used as they
    are."""
    given = {name: value for name, value in kwargs.items() if not isinstance(value, (str, torch.dtype, dict))}
    options = {name: value for name, value in kwargs.items() if name not in given}
    pipeline = ModularPipeline.from_pretrained(model, workflow=workflow)
    if workflow is None and type(pipeline).__name__ in TRAINED_WORKFLOWS:
        pipeline = ModularPipeline.from_pretrained(model, workflow=TRAINED_WORKFLOWS[type(pipeline).__name__])
    names = [name for name in pipeline.pretrained_component_names if name not in given]
    with warnings.catch_warnings():  # (components that fail to load are reported below, not as warnings)
        warnings.simplefilter("ignore")
        pipeline.load_components(names=names, **options)
    if given:
        pipeline.update_components(**given)
    return pipeline


__all__ = [
    "MODULAR_INDEX",
    "TINY_RESOLUTION",
    "TINY_SAMPLING",
    "TINY_SAMPLING_FILE",
    "TRAINED_WORKFLOWS",
    "is_tiny_folder",
    "load_modular_pipeline",
    "load_tiny_pipeline",
    "qwen_vl_processor",
]
