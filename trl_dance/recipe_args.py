"""Command-line handling shared by the training scripts (``trl_dance/scripts/``, run by ``trl-dance grpo|nft|dpo`` and
``recipes/*.py``): TRL's parser with ``--config`` named first, the ``trl.ModelConfig`` fields the recipes use (the others refused, not silently ignored), and
``module:function`` rewards from the working directory."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from trl import ModelConfig, TrlParser

# The ModelConfig fields the recipes pass on: the model, its dtype and a peft LoRA (get_peft_config).
USED_MODEL_FIELDS = (
    "model_name_or_path",
    "model_revision",
    "dtype",
    "use_peft",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_modules_to_save",
    "lora_task_type",
    "use_rslora",
    "use_dora",
)

USAGE = """%(prog)s --config FILE.yaml [--option value ...]

--config FILE.yaml: a YAML file setting any of the options below (recipes/configs/ has one per model); options given
on the command line override it. The options are those of the script, of the trainer's config and of trl.ModelConfig
(model_name_or_path, dtype, use_peft, lora_*)."""


def recipe_parser(dataclass_types: tuple[type, ...], prog: str | None = None) -> TrlParser:
    """TRL's parser of ``dataclass_types`` with the usage line naming ``--config``."""
    # No abbreviations: `--learning_rat 0.1` would set learning_rate silently, and a prefix of two fields would
    # become an error the day a second field shares it.
    return TrlParser(dataclass_types, prog=prog, usage=USAGE, allow_abbrev=False)


def parse_recipe_args(dataclass_types: tuple[type, ...], argv: list[str] | None = None) -> tuple[Any, ...]:
    """``recipe_parser(dataclass_types).parse_args_and_config(argv)``, with the ``ModelConfig`` instance checked by
    :func:`check_model_args`."""
    parsed = recipe_parser(dataclass_types).parse_args_and_config(argv)
    for value in parsed:
        if isinstance(value, ModelConfig):
            check_model_args(value)
    return parsed


def check_model_args(model_args: ModelConfig) -> None:
    """Raise ``ValueError`` naming any ``ModelConfig`` field set away from its default that the recipes do not use
    (quantization, attention implementation, ...): it would otherwise be accepted and silently ignored."""
    defaults = ModelConfig()
    unused = [
        f"{field.name}={getattr(model_args, field.name)!r}"
        for field in dataclasses.fields(ModelConfig)
        if field.name not in USED_MODEL_FIELDS and getattr(model_args, field.name) != getattr(defaults, field.name)
    ]
    if unused:
        raise ValueError(
            f"trl-dance recipes do not use {', '.join(unused)} (trl.ModelConfig fields for transformers models); "
            f"remove them. The model options they use: {', '.join(USED_MODEL_FIELDS)}"
        )
    if model_args.model_name_or_path is None:
        raise ValueError("--model_name_or_path is required (a Hub id or a local pipeline folder)")


def model_init_kwargs(training_args: Any, model_args: ModelConfig) -> None:
    """Pass ``dtype`` and ``model_revision`` on to ``DiffusionPipeline.from_pretrained`` through the trainer config's
    ``model_init_kwargs``."""
    kwargs = dict(training_args.model_init_kwargs or {})
    if model_args.dtype is not None:
        kwargs["dtype"] = model_args.dtype
    if model_args.model_revision not in (None, "main"):
        kwargs["revision"] = model_args.model_revision
    training_args.model_init_kwargs = kwargs or None


def stopped_early(trainer) -> bool:
    """After ``train``: whether a preemption signal stopped it (its checkpoint written); if so, the main process says
    where the run stopped and the command that resumes it, and the script writes no final-looking outputs."""
    if trainer.stopped_by is None:
        return False
    if trainer.accelerator.is_main_process:
        import shlex

        from .launch_env import CLI_ARGV_ENV

        args, step = trainer.args, trainer.state.global_step
        # The command as typed (trl-dance's, launcher options included), else this script's.
        resume = shlex.split(os.environ.get(CLI_ARGV_ENV, "")) or [sys.executable, *sys.argv]
        if "--resume_from_checkpoint" not in resume:
            resume += ["--resume_from_checkpoint", "true"]
        print(
            f"stopped by {trainer.stopped_by} at step {step} of {trainer.state.max_steps}: checkpoint "
            f"{os.path.join(args.output_dir, f'checkpoint-{step}')}; resume with:\n  {shlex.join(resume)}",
            flush=True,
        )
    return True


def finish(trainer) -> None:
    """End a script's run on every process together: wait for the others, then destroy the process group
    (``Accelerator.end_training``), so that no process exits while another still talks to it (a gloo worker then
    aborts with "terminate called without an active exception")."""
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
