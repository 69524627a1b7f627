"""The ``trl-dance`` command.

    trl-dance grpo --config FILE.yaml [--accelerate_config ddp|zero2|zero3|fsdp2|multinode|PATH] [accelerate launch options]
    trl-dance nft  --config FILE.yaml [...]          DiffusionNFT / AWM / DGPO
    trl-dance dpo  --config FILE.yaml [...]          Diffusion-DPO
    trl-dance online-dpo --config FILE.yaml [...]    online Diffusion-DPO from AI feedback
    trl-dance spo  --config FILE.yaml [...]          SPO (step-aware preference optimization)
    trl-dance direct --config FILE.yaml [...]        SRPO's Direct-Align, DRaFT-K, AlignProp
    trl-dance eval --model_name_or_path BASE --prompts_file FILE --checkpoints DIR ... --reward_funcs NAME ...
    trl-dance serve-reward NAME --port 8000          a reward behind HTTP (reward_funcs: [http://host:8000])
    trl-dance tiny KIND DIR                          a tiny random-weight pipeline for trying things offline
    trl-dance env                                    versions and devices, for bug reports

The training commands (one per row of :data:`trl_dance.methods.METHODS`) work as TRL's CLI does: options the script
does not know (``--num_processes 8``, ``--accelerate_config zero2``) go to ``accelerate launch``, which runs
``trl_dance/scripts/train.py --command NAME``; ``--accelerate_config`` names a config shipped in
``trl_dance/accelerate_configs/`` or a file.
"""

from __future__ import annotations

import importlib
import importlib.resources
import os
import sys

from .methods import METHODS

OTHER_COMMANDS = {
    "eval": ("trl_dance.scripts.evaluate", "compare a base pipeline with LoRAs/checkpoints on any rewards"),
    "serve-reward": ("trl_dance.rewards.server", "serve a reward over HTTP for remote scoring (reward_funcs: [URL])"),
    "tiny": ("trl_dance.testing", "save a tiny random-weight pipeline (trl-dance tiny --help lists the kinds)"),
    "env": ("trl_dance.cli", "print the versions and devices a bug report needs (as `trl env`)"),
}


def accelerate_configs() -> dict[str, str]:
    """The shipped accelerate configs by name (ddp, zero2, zero3, fsdp2, multinode) and their paths."""
    folder = importlib.resources.files("trl_dance") / "accelerate_configs"
    return {entry.name.removesuffix(".yaml"): str(entry) for entry in folder.iterdir() if entry.name.endswith(".yaml")}


def resolve_accelerate_config(launch_args: list[str]) -> list[str]:
    """``--accelerate_config NAME|PATH`` in ``launch_args`` → ``--config_file PATH`` (accelerate's option)."""
    if "--accelerate_config" not in launch_args:
        return launch_args
    index = launch_args.index("--accelerate_config")
    if index + 1 >= len(launch_args):
        raise ValueError("--accelerate_config needs a value: one of the shipped configs or a file")
    value, shipped = launch_args[index + 1], accelerate_configs()
    if os.path.isfile(value):
        path = value
    elif value in shipped:
        path = shipped[value]
    else:
        raise ValueError(
            f"--accelerate_config {value!r} is neither a file nor a shipped config ({', '.join(sorted(shipped))})"
        )
    return ["--config_file", path, *launch_args[:index], *launch_args[index + 2 :]]


def _without(argv: list[str], subsequence: list[str]) -> list[str]:
    """``argv`` minus the ordered ``subsequence`` (the options that go to the launcher)."""
    remaining, pending = [], iter(subsequence)
    current = next(pending, None)
    for item in argv:
        if current is not None and item == current:
            current = next(pending, None)
        else:
            remaining.append(item)
    return remaining


def launch_training(command: str, argv: list[str]) -> None:
    """Split ``argv`` into the script's options and the launcher's, then ``accelerate launch`` the script."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    from .scripts import train
    from .trainer.context_parallel import planned_world_size

    train.resolve_method(["--command", command, *argv])  # a YAML recipe of another method: say which command runs it

    def parse():  # (a parser per pass: reading the YAML file sets its defaults)
        parser = train.make_parser(command, prog=f"trl-dance {command}")
        return parser.parse_args_and_config(argv, return_remaining_strings=True, separate_remaining_strings=True)

    # -h exits here. Options neither the script nor the YAML file knows are the launcher's. This process is not one
    # of the run's: the checks that need the run's process count wait until the launch options give it.
    with planned_world_size("groups"):
        *_, config_remaining, cli_remaining = parse()
    launch_args = resolve_accelerate_config(config_remaining + cli_remaining)
    script_args = _without(argv, cli_remaining)
    script = [train.__file__, "--command", command, *script_args]
    launch = launch_command_parser().parse_args([*launch_args, *script])
    with planned_world_size(planned_processes(launch)):
        parse()  # the whole config, checked for the processes about to start
    launch_command(launch)


def planned_processes(launch) -> int:
    """How many processes ``accelerate launch`` will start for the parsed ``launch`` options (its own resolution of the
    options, the config file and its defaults)."""
    import copy

    from accelerate.commands.launch import _validate_launch_command

    resolved, *_ = _validate_launch_command(copy.deepcopy(launch))
    return resolved.num_processes or 1


def env() -> str:
    """What a bug report needs: platform, Python, trl-dance and its ecosystem's versions, devices (as ``trl env``)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from .version import __version__

    lines = [
        f"- Platform: {platform.platform()}",
        f"- Python version: {platform.python_version()}",
        f"- trl-dance version: {__version__}",
    ]
    for package in ("torch", "diffusers", "transformers", "trl", "accelerate", "peft", "datasets", "deepspeed"):
        try:
            lines.append(f"- {package} version: {version(package)}")
        except PackageNotFoundError:
            lines.append(f"- {package} version: not installed")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(
            f"- Accelerators: {torch.cuda.device_count()} × {', '.join(sorted(set(names)))} (CUDA {torch.version.cuda})"
        )
    else:
        lines.append(f"- Accelerators: none (CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)")
    return "\n".join(["Copy-paste the following information when you open an issue:", "", *lines])


def _usage() -> str:
    commands = {name: method.help for name, method in METHODS.items()}
    commands |= {name: help_text for name, (_, help_text) in OTHER_COMMANDS.items()}
    lines = [f"  {name:<14}{help_text}" for name, help_text in commands.items()]
    return "usage: trl-dance {" + ",".join(commands) + "} ...\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command in METHODS:
        launch_training(command, rest)
    elif command == "env":
        print(env())
    elif command in OTHER_COMMANDS:
        importlib.import_module(OTHER_COMMANDS[command][0]).main(rest)
    else:
        print(f"trl-dance: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
