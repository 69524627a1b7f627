"""The training script of every method (:data:`trl_dance.methods.METHODS`).

    trl-dance grpo --config recipes/configs/grpo_flux.yaml [--accelerate_config ddp|zero2|zero3|fsdp2]
    accelerate launch recipes/train.py --config recipes/configs/grpo_flux.yaml      # the same script
    accelerate launch recipes/grpo_flux.py --config recipes/configs/grpo_flux.yaml  # the same (a link to train.py)

The method is ``--command NAME`` (a ``trl-dance`` command), else the YAML file's ``command:`` (every shipped recipe
has one), else the script's file name (``grpo_flux.py`` → ``grpo``, ``ddpo_sd.py`` → ``grpo``, ``dpo_sdxl.py`` → ``dpo``). Any field of the
method's config, of ``trl.ModelConfig`` (model_name_or_path, dtype, use_peft, lora_*) or of the job's script
arguments (:mod:`~trl_dance.scripts.from_rollouts` for prompts and rewards, :mod:`~trl_dance.scripts.from_dataset`
for datasets of images) can be given in the YAML file or on the command line, which overrides it.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: see trl_dance/cli.py

import argparse
import importlib
import sys
from dataclasses import dataclass, field

import yaml
from trl import ModelConfig

from trl_dance.methods import METHODS, Method, get_method
from trl_dance.recipe_args import parse_recipe_args, recipe_parser

JOBS = {"prompts": "trl_dance.scripts.from_rollouts", "dataset": "trl_dance.scripts.from_dataset"}


@dataclass
class MethodArguments:
    # The training method (grpo | nft | ...; see the module docstring): internal, the trl-dance command sets it, so
    # the help does not list it.
    command: str | None = field(default=None, metadata={"help": argparse.SUPPRESS})


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``argv`` (the last one), else None."""
    value = None
    for index, item in enumerate(argv):
        if item == name and index + 1 < len(argv):
            value = argv[index + 1]
        elif item.startswith(name + "="):
            value = item.split("=", 1)[1]
    return value


def _from_script_name(path: str) -> Method | None:
    """The method a recipe file is named after: its name, or its longest ``_``-separated prefix, as a method or alias."""
    parts = os.path.splitext(os.path.basename(path))[0].split("_")
    for end in range(len(parts), 0, -1):
        try:
            return get_method("_".join(parts[:end]))
        except ValueError:
            continue
    return None


def resolve_method(argv: list[str], script: str | None = None) -> Method:
    """The method to train: ``--command``, the ``--config`` YAML's ``command:`` (both given: they must agree), or the
    script's file name; ``ValueError`` naming the ways to say it if none does."""
    given = _option(argv, "--command")
    config = _option(argv, "--config")
    in_yaml = None
    if config is not None and os.path.isfile(config):
        with open(config, encoding="utf-8") as handle:
            in_yaml = (yaml.safe_load(handle) or {}).get("command")
    if given is not None and in_yaml is not None and get_method(given) != get_method(in_yaml):
        raise ValueError(
            f"{config} is a {in_yaml!r} recipe (its command:), not {given!r}: run `trl-dance {get_method(in_yaml).name}`"
        )
    if given is not None or in_yaml is not None:
        return get_method(given or in_yaml)
    method = _from_script_name(script or sys.argv[0])
    if method is None:
        raise ValueError(
            f"which method? Give --command ({' | '.join(METHODS)}), a `command:` line in the YAML file, or run "
            "`trl-dance COMMAND`"
        )
    return method


def _types(method: Method) -> tuple[type, ...]:
    job = importlib.import_module(JOBS[method.data])
    return (MethodArguments, job.ScriptArguments, method.config_class, ModelConfig)


def make_parser(method: str, prog: str | None = None):
    """The parser of ``method``'s script (``trl-dance`` separates the launcher's options with it)."""
    return recipe_parser(_types(get_method(method)), prog)


def main(argv: list[str] | None = None, script: str | None = None):
    """Parse the command line (and ``--config`` YAML) for the resolved method and run its job; returns the trainer."""
    argv = sys.argv[1:] if argv is None else list(argv)
    method = resolve_method(argv, script)
    _, script_args, training_args, model_args = parse_recipe_args(_types(method), argv)
    job = importlib.import_module(JOBS[method.data])
    return job.main(script_args, training_args, model_args, trainer_class=method.trainer_class)


if __name__ == "__main__":
    from trl_dance.launch_env import CLI_ENV, DEBUG_ENV, user_error

    try:
        main()
    except (ValueError, OSError) as error:  # a user error under `trl-dance`: one line, as the command's own
        command = os.environ.get(CLI_ENV)
        if command is None or os.environ.get(DEBUG_ENV):
            raise
        if os.environ.get("RANK", "0") == "0":
            print(user_error(command, error), file=sys.stderr)
        sys.exit(2)
