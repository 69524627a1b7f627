"""The ``trl-dance`` command.

    trl-dance grpo --config FILE.yaml [--accelerate_config ddp|zero2|zero3|fsdp2|multinode|PATH] [accelerate launch options]
    trl-dance nft  --config FILE.yaml [...]          DiffusionNFT / AWM / DGPO / ART
    trl-dance dpo  --config FILE.yaml [...]          Diffusion-DPO
    trl-dance online-dpo --config FILE.yaml [...]    online Diffusion-DPO from AI feedback
    trl-dance spo  --config FILE.yaml [...]          SPO (step-aware preference optimization)
    trl-dance direct --config FILE.yaml [...]        SRPO's Direct-Align, DRaFT-K, AlignProp
    trl-dance eval --model_name_or_path BASE --prompts_file FILE --checkpoints DIR ... --reward_funcs NAME ...
    trl-dance serve-reward NAME --port 8000          a reward behind HTTP (reward_funcs: [http://host:8000])
    trl-dance serve-rollouts --model BASE --port 8100  a rollout worker (rollout_server_urls: [http://host:8100])
    trl-dance tiny KIND DIR                          a tiny random-weight pipeline for trying things offline
    trl-dance env                                    versions and devices, for bug reports
    trl-dance --version

The training commands (one per row of :data:`trl_dance.methods.METHODS`) work as TRL's CLI does: options the script
does not know (``--num_processes 8``, ``--accelerate_config zero2``) go to ``accelerate launch``, which runs
``trl_dance/scripts/train.py --command NAME``; ``--accelerate_config`` names a config shipped in
``trl_dance/accelerate_configs/`` or a file.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.resources
import os
import shlex
import subprocess
import sys

# OpenMP's default active wait keeps torch's idle threads spinning after every parallel region; where other processes
# use the same cores, they spin against them (measured on a 2-core machine with two other training processes: tiny
# Diffusion-DPO 1.1 it/s by default, 4.7 it/s passive). Read when torch loads its OpenMP runtime, so the entry points
# (this command, which the launched scripts inherit, and scripts/train.py) set it before torch, as `import trl_dance`
# does where torch is not loaded yet; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .launch_env import CLI_ARGV_ENV, CLI_ENV, DEBUG_ENV, user_error  # noqa: E402
from .methods import METHODS  # noqa: E402

OTHER_COMMANDS = {
    "eval": ("trl_dance.scripts.evaluate", "compare a base pipeline with LoRAs/checkpoints on any rewards"),
    "serve-reward": ("trl_dance.rewards.server", "serve a reward over HTTP for remote scoring (reward_funcs: [URL])"),
    "serve-rollouts": (
        "trl_dance.scripts.serve_rollouts",
        "a rollout worker on another GPU or node (rollout_server_urls: [URL])",
    ),
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
    check_unknown_options(argv, config_remaining, cli_remaining, train.make_parser(command))
    launch_args = resolve_accelerate_config(config_remaining + cli_remaining)
    script_args = _without(argv, cli_remaining)
    script = [train.__file__, "--command", command, *script_args]
    launch = resolved_launch(launch_command_parser().parse_args([*launch_args, *script]))
    with planned_world_size(planned_processes(launch)):
        parse()  # the whole config, checked for the processes about to start
    os.environ[CLI_ENV] = command  # the launched script reports user errors as this command does
    os.environ[CLI_ARGV_ENV] = shlex.join(["trl-dance", command, *argv])  # and says how to resume a stopped run
    with preemption_reaches_the_script() as stopped:
        try:
            launch_command(launch)
        except SystemExit:  # accelerate's exit after a signal: the script's own status instead (0 once it saved)
            if stopped.get("status") is None:
                raise
            if stopped["status"]:
                raise SystemExit(stopped["status"]) from None


@contextlib.contextmanager
def preemption_reaches_the_script():
    """While ``accelerate launch`` runs the script as its child (one process): the preemption signals reach the
    script, which finishes its update, saves a checkpoint and stops, and the launcher waits for it. accelerate's
    launcher answers SIGTERM by terminating the script and SIGKILLing it 5 s later, then exits 143 (an update and a
    checkpoint rarely fit in 5 s), and dies of SIGUSR1 (SLURM's ``--signal``) at once. Yields a dict whose
    ``status`` is the script's exit status once a signal made the launcher wait for it."""
    import signal
    import threading

    import psutil
    from accelerate.commands import launch as accelerate_launch

    stopped: dict = {}
    if threading.current_thread() is not threading.main_thread():  # (signal handlers live in the main thread)
        yield stopped
        return

    def forward(number, frame=None):  # to the script (a repeat within 5 s is the same request to it)
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(number)

    def wait_for(process):  # in place of accelerate's _terminate_process_tree
        numbers = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
        previous = {number: signal.signal(number, forward) for number in numbers}
        try:
            forward(signal.SIGTERM)
            stopped["status"] = process.wait()
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    terminate, accelerate_launch._terminate_process_tree = accelerate_launch._terminate_process_tree, wait_for
    usr1 = signal.signal(signal.SIGUSR1, forward)
    try:
        yield stopped
    finally:
        accelerate_launch._terminate_process_tree = terminate
        signal.signal(signal.SIGUSR1, usr1)


def check_unknown_options(argv: list[str], config_remaining: list[str], cli_remaining: list[str], parser) -> None:
    """Options that neither the script nor ``accelerate launch`` knows, from the YAML file (``config_remaining``) or
    the command line (``cli_remaining``): refused in one line naming the file or the flag and the closest option
    (accelerate would print its whole usage and ``unrecognized arguments``, naming neither)."""
    import difflib

    from accelerate.commands.launch import launch_command_parser

    launcher = {option.lstrip("-") for option in launch_command_parser()._option_string_actions}
    launcher.add("accelerate_config")  # trl-dance's own launcher option (resolve_accelerate_config)
    fields = [option.lstrip("-") for option in parser._option_string_actions if option.startswith("--")]

    def unknown(items: list[str]) -> list[str]:
        names = [item.split("=", 1)[0].lstrip("-") for item in items if item.startswith("-") and len(item) > 1]
        return [name for name in names if name not in launcher and not _is_number(name)]

    def hints(names: list[str], show) -> str:  # show: how a name is written (a YAML key, a flag)
        close = [difflib.get_close_matches(name, fields + sorted(launcher), n=1) for name in names]
        return ", ".join(show(n) + (f" (did you mean {show(c[0])}?)" if c else "") for n, c in zip(names, close))

    if keys := unknown(config_remaining):
        config = argv[argv.index("--config") + 1] if "--config" in argv else "the config file"
        raise ValueError(
            f"{config}: unknown keys {hints(keys, repr)}: neither a training field nor an accelerate option"
        )
    if flags := unknown(cli_remaining):
        raise ValueError(f"unknown option {hints(flags, lambda name: '--' + name)}: neither a training field nor an "
                         "accelerate launch option (`--help_all` lists them)")  # fmt: skip


def _is_number(text: str) -> bool:
    """A negative number's digits (``-1`` is a value, not an option)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def resolved_launch(launch):
    """The parsed ``launch`` options as ``accelerate launch`` resolves them (the config file, its defaults: the GPU
    count, one machine, no mixed precision, no dynamo), without its notes on the defaults it filled in: launched with
    them, it prints nothing (it printed its note twice, the same every run)."""
    import contextlib
    import copy
    import io
    import logging

    from accelerate.commands.launch import _validate_launch_command

    quiet = logging.getLogger("accelerate.commands.launch")
    before, quiet.disabled = quiet.disabled, True
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            resolved, *_ = _validate_launch_command(copy.deepcopy(launch))
    finally:
        quiet.disabled = before
    return resolved


def planned_processes(resolved) -> int:
    """How many processes ``accelerate launch`` will start for the ``resolved`` launch options
    (:func:`resolved_launch`). ``--num_processes N`` without ``--multi_gpu`` would run one process (accelerate's
    simple launcher): on a machine without GPUs it becomes N CPU processes over gloo (``--multi_gpu`` with
    ``ACCELERATE_USE_CPU=1``, said in one line); with GPUs it is refused naming the flag."""
    import torch

    processes = resolved.num_processes or 1
    several = (
        resolved.use_deepspeed or resolved.tpu or ((resolved.multi_gpu or resolved.use_fsdp) and not resolved.cpu)
    )
    if processes > 1 and not several:
        if torch.cuda.is_available():
            raise ValueError(
                f"--num_processes {processes} would start one process (accelerate's single-process launcher): add "
                "--multi_gpu or --accelerate_config ddp"
            )
        resolved.multi_gpu, resolved.cpu = True, False
        os.environ["ACCELERATE_USE_CPU"] = "1"
        print(f"trl-dance: {processes} CPU processes over gloo (--multi_gpu with ACCELERATE_USE_CPU=1)", flush=True)
    return processes


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


_COMMON = {
    "prompts": [
        ("--reward_funcs NAME ...", "registered rewards, module:function, or http(s) URLs of reward servers"),
        ("--prompts_file FILE", "prompts: .txt (one per line), .jsonl or .csv (or --dataset_name)"),
        ("--num_generations G", "samples per prompt (a group); --generation_batch_size N samples per round"),
    ],
    "dataset": [
        ("--dataset_name NAME", "the training data: a Hub id, a saved dataset folder or an image folder"),
        ("--resolution N", "training size (videos: --num_frames F)"),
    ],
}


_METHOD_PAGES = {"online-dpo": "dpo"}


def short_help(command: str) -> str:
    """``trl-dance COMMAND --help``: the options most runs set, without importing the trainers (``--help_all`` lists
    every option of the script and the method's config)."""
    method = METHODS[command]
    options = [
        ("--config FILE.yaml", "a recipe (recipes/configs/ has one per model); the command line overrides it"),
        ("--model_name_or_path ID", "the diffusers pipeline: a Hub id or a local folder"),
        ("--output_dir DIR", "checkpoints, the LoRA (diffusers format), samples and the model card"),
        ("--use_peft --lora_r N ...", "train a LoRA (peft; --lora_alpha, --lora_target_modules)"),
        *_COMMON[method.data],
        ("--learning_rate LR", "and --max_steps N, --seed N, --bf16"),
        ("--per_device_train_batch_size N", "and --gradient_accumulation_steps N"),
        ("--report_to NAME", "trackers (tensorboard, wandb, trackio, none); --logging_steps N"),
        ("--save_steps N", "checkpoints; --resume_from_checkpoint [PATH] continues a run"),
        ("--push_to_hub", "upload the trained model and its card (--hub_model_id ID)"),
    ]
    launcher = [
        ("--accelerate_config NAME", "ddp | zero2 | zero3 | fsdp2 | multinode, or a file"),
        ("--num_processes N", "and any other accelerate launch option (--multi_gpu, --num_machines, ...)"),
    ]

    def block(rows):
        return "\n".join(f"  {flag:<34}{text}" for flag, text in rows)

    return (
        f"usage: trl-dance {command} --config FILE.yaml [--option value ...] [accelerate launch options]\n\n"
        f"{method.help}.\n\ncommon options:\n{block(options)}\n\nlauncher options:\n{block(launcher)}\n\n"
        f"trl-dance {command} --help_all lists every option with its default; the method's page is "
        f"docs/methods/{_METHOD_PAGES.get(command, command)}.md."
    )


def _usage() -> str:
    commands = {name: method.help for name, method in METHODS.items()}
    commands |= {name: help_text for name, (_, help_text) in OTHER_COMMANDS.items()}
    width = max(map(len, commands)) + 2
    lines = [f"  {name:<{width}}{help_text}" for name, help_text in commands.items()]
    return "usage: trl-dance {" + ",".join(commands) + "} ...\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command; a user error (a bad value, a missing file) is one line on stderr and exit status 2, its traceback
    kept with ``TRL_DANCE_DEBUG=1``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from .version import __version__

        print(f"trl-dance {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in METHODS and ("-h" in rest or "--help" in rest):
        print(short_help(command))
        return 0
    rest = ["--help" if item == "--help_all" else item for item in rest]
    try:
        if command in METHODS:
            launch_training(command, rest)
        elif command == "env":
            print(env())
        elif command in OTHER_COMMANDS:
            importlib.import_module(OTHER_COMMANDS[command][0]).main(rest)
        else:
            print(f"trl-dance: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
            return 2
    except subprocess.CalledProcessError as error:  # the launched script failed and said why (user errors in one line)
        if os.environ.get(DEBUG_ENV):
            raise
        return error.returncode
    except (ValueError, OSError) as error:  # bad values, missing or unreadable files and folders
        if os.environ.get(DEBUG_ENV):
            raise
        print(user_error(command, error), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
