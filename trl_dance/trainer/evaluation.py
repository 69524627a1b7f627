"""What evaluation shares between the trainers: its settings, its sampler, and where its images go.

An evaluation samples with the deterministic sampler (no SDE noise) from noise seeded by (``eval_seed``, row index),
so evaluations at different steps compare policies on the same starts, with settings of its own (steps, guidance,
negative prompt) that default to those of training (GRPO) or of the pipeline's ``__call__`` (DPO).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from diffusers import DiffusionPipeline

from ..policies import DiffusionPolicy, make_policy


@dataclass
class EvaluationArguments:
    r"""
    Parameters:
        eval_seed (`int`, defaults to `0`): Seed of the evaluation noise: every evaluation starts from the same noise.
        eval_num_inference_steps (`int` or `None`, defaults to `None`): Denoising steps of evaluation samples.
        eval_guidance_scale (`float` or `None`, defaults to `None`): CFG scale of evaluation samples (FLUX: its
            guidance-embedding value).
        eval_negative_prompt (`str` or `None`, defaults to `None`): Negative prompt of evaluation samples (CFG
            families). `None` in these three: the training sampler's value (online trainers) or the pipeline's own
            default (Diffusion-DPO).
    """

    eval_seed: int = field(
        default=0, metadata={"help": "Seed of the evaluation noise (the same at every evaluation)."}
    )
    eval_num_inference_steps: int | None = field(default=None, metadata={"help": "Denoising steps of evaluation."})
    eval_guidance_scale: float | None = field(default=None, metadata={"help": "Guidance scale of evaluation."})
    eval_negative_prompt: str | None = field(default=None, metadata={"help": "Negative prompt of evaluation."})

    def _check_evaluation(self) -> None:
        if self.eval_num_inference_steps is not None and self.eval_num_inference_steps < 1:
            raise ValueError(f"eval_num_inference_steps must be >= 1, got {self.eval_num_inference_steps}")
        scale = self.eval_guidance_scale
        if scale is not None and not (scale >= 0 and math.isfinite(scale)):
            raise ValueError(f"eval_guidance_scale must be a number >= 0, got {scale}")


def pipeline_call_defaults(pipeline: DiffusionPipeline) -> dict[str, Any]:
    """``num_inference_steps`` and ``guidance_scale`` as the pipeline's ``__call__`` defaults them (SD1.5: 50, 7.5;
    SDXL: 50, 5.0; SD3: 28, 7.0; FLUX: 28, 3.5)."""
    parameters = inspect.signature(type(pipeline).__call__).parameters
    return {
        name: parameters[name].default
        for name in ("num_inference_steps", "guidance_scale")
        if name in parameters and parameters[name].default is not inspect.Parameter.empty
    }


STOCHASTIC_SAMPLING_SDE = {"sde_type": "cps", "eta": 1.0}
"""The sampler of a record with ``stochastic_sampling``: each clean prediction re-noised with fresh noise (CPS at η = 1,
DMD2's backward simulation, diffusers' ``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)``)."""

SAMPLING_FILE = "trl_dance_sampling.json"
"""Beside a run's saved weights: how the trained model samples (:func:`sampling_record`), read by ``trl-dance eval``."""

RECORDED_SETTINGS = ("num_inference_steps", "guidance_scale", "sigma_schedule", "shift", "height", "width", "num_frames",
                     "negative_prompt", "max_sequence_length", "guidance_scale_2")  # fmt: skip


def sampling_record(policy: DiffusionPolicy) -> dict[str, Any]:
    """How ``policy``'s deterministic sampler samples: the :data:`RECORDED_SETTINGS` and, for flow families, its
    σ grid (``sigmas``: the N noise levels the steps start from, 1 → 0 exclusive), so that a few-step student is
    evaluated and used on the grid it was trained on. A trainer whose model samples with fresh noise at each step
    (DMD2's backward simulation) adds ``stochastic_sampling: True``."""
    record = {name: getattr(policy.settings, name) for name in RECORDED_SETTINGS}
    if (sigmas := sigma_grid(policy)) is not None:
        record["sigmas"] = [round(value, 6) for value in sigmas[:-1]]
    return record


def sigma_grid(policy: DiffusionPolicy) -> tuple[float, ...] | None:
    """``policy``'s σ table (N + 1 levels, 1 → 0), or None where it has none: a DDIM family, or one grid per stream
    (MiniMax-H3's video and audio, whose settings say it)."""
    try:
        return getattr(policy.process, "sigma_values", None)
    except NotImplementedError:
        return None


def read_sampling_record(folder: str) -> dict[str, Any] | None:
    """The :data:`SAMPLING_FILE` record in ``folder`` (None where there is none)."""
    import json
    import os

    path = os.path.join(folder, SAMPLING_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def sampling_call_code(record: dict[str, Any], pipeline: DiffusionPipeline, prompt: str = "a photo of a cat") -> str:
    """The diffusers lines that sample as ``record`` says: steps and guidance, and, for a σ grid other than the
    scheduler's (``sigma_schedule="dance"``), that grid passed as ``sigmas`` to a scheduler that does not shift it
    again (``shift=1``, no dynamic shifting); ``stochastic_sampling`` (DMD2's re-noising sampler) switched on where the
    record has it."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    arguments = [repr(prompt), f"num_inference_steps={record['num_inference_steps']}",
                 f"guidance_scale={record['guidance_scale']}"]  # fmt: skip
    lines, options, notes = [], [], []
    own_grid = record.get("sigma_schedule") == "dance" and record.get("sigmas")
    if isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler):
        if own_grid:
            options.append("shift=1.0, use_dynamic_shifting=False")
            notes.append("the σ grid of training, as it is: a scheduler that shifts nothing")
            arguments[1] = f"sigmas={record['sigmas']}"
        if record.get("stochastic_sampling"):
            options.append("stochastic_sampling=True")
            notes.append("fresh noise at each step, as the model was trained to sample")
    if options:
        note = "; ".join(notes)
        lines = [
            "from diffusers import FlowMatchEulerDiscreteScheduler",
            "",
            f"# {note[0].upper()}{note[1:]}",
            "pipeline.scheduler = FlowMatchEulerDiscreteScheduler.from_config(",
            f"    pipeline.scheduler.config, {', '.join(options)}",
            ")",
        ]
    if record.get("negative_prompt"):
        arguments.append(f"negative_prompt={record['negative_prompt']!r}")
    output = "video = pipeline({}).frames[0]" if record.get("num_frames") else "image = pipeline({}).images[0]"
    return "\n".join([*lines, output.format(", ".join(arguments))])


def evaluation_policy(policy: DiffusionPolicy, args: EvaluationArguments, **defaults: Any) -> DiffusionPolicy:
    """The sampler of evaluation: ``policy``'s settings with ``defaults`` (SamplerSettings fields) and then the config's
    ``eval_*`` values where set; ``policy`` itself when nothing changes."""
    given = {
        "num_inference_steps": args.eval_num_inference_steps,
        "guidance_scale": args.eval_guidance_scale,
        "negative_prompt": args.eval_negative_prompt,
    }
    return policy_with(policy, **(defaults | {name: value for name, value in given.items() if value is not None}))


def policy_with(policy: DiffusionPolicy, pipeline: DiffusionPipeline | None = None, **changes: Any) -> DiffusionPolicy:
    """``policy`` with some SamplerSettings ``changes`` (and, if given, over a view of its ``pipeline`` with other
    settings): a second policy on the same components (it holds no weights of its own), the same runtime object
    (offloading, context-parallel gradient scale) and condition columns, or ``policy`` itself when nothing changes."""
    settings = dataclasses.replace(policy.settings, **changes)
    pipeline = policy.pipeline if pipeline is None else pipeline
    if settings == policy.settings and pipeline is policy.pipeline:
        return policy
    other = make_policy(pipeline, settings, runtime=policy.runtime)
    other.use_condition_columns(list(policy.condition_columns))  # (the optional columns the run conditions on)
    return other
