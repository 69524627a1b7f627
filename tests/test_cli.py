"""The ``trl-dance`` command, installed from a wheel into a folder outside the repository and run from there: a
tiny pipeline, a GRPO run through ``accelerate launch`` that saves checkpoints, and ``trl-dance eval`` of the base
against two of them."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from datasets import load_dataset

from trl_dance.cli import accelerate_configs, main, resolve_accelerate_config
from trl_dance.scripts.evaluate import _table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_accelerate_config_names_and_files(tmp_path):
    shipped = accelerate_configs()
    assert sorted(shipped) == ["ddp", "fsdp2", "multinode", "zero2", "zero3"] and all(
        map(os.path.isfile, shipped.values())
    )
    assert resolve_accelerate_config(["--num_processes", "2", "--accelerate_config", "zero2"]) == [
        "--config_file", shipped["zero2"], "--num_processes", "2",
    ]  # fmt: skip
    own = tmp_path / "mine.yaml"
    own.write_text("distributed_type: NO\n")
    assert resolve_accelerate_config(["--accelerate_config", str(own)]) == ["--config_file", str(own)]
    with pytest.raises(
        ValueError, match=r"'zero4' is neither a file nor a shipped config \(ddp, fsdp2, multinode, zero2, zero3\)"
    ):
        resolve_accelerate_config(["--accelerate_config", "zero4"])
    assert main(["unknown"]) == 2 and main([]) == 0


def test_win_rate_and_standard_error():
    """Win rate over paired samples (ties count ½); standard error = sample std / √n."""
    base = torch.tensor([[0.1], [0.2], [0.3], [0.4]])
    results = {"base": base, "a": torch.tensor([[0.2], [0.2], [0.1], [0.5]])}  # win, tie, loss, win
    lines = _table(["r"], results)
    assert lines[3] == "| a | 0.2500 ± 0.0866 | 0.625 |" and lines[2].startswith("| base | 0.2500 ± 0.0645 | –")


def test_installed_cli_trains_and_evaluates_outside_the_repository(tmp_path):
    source = tmp_path / "source"  # a copy of the tracked tree: a stale build/ of the clone cannot leak into the wheel
    ignore = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "outputs", "__pycache__", ".pytest_cache")
    shutil.copytree(ROOT, source, ignore=ignore)
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(source)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def run(*args):
        completed = subprocess.run(
            [str(site / "bin" / "trl-dance"), *args], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )
        assert completed.returncode == 0, completed.stderr[-4000:]
        return completed.stdout

    where = subprocess.run(
        [sys.executable, "-c", "import trl_dance; print(trl_dance.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(str(site))  # the installed copy, not the repository's
    run("tiny", "flux", "tiny-flux")
    (work / "prompts.txt").write_text("a cat\na dog\na red house\na tree\n")
    (work / "grpo.yaml").write_text(
        "model_name_or_path: tiny-flux\nuse_peft: true\nlora_r: 4\nlora_alpha: 4\nlora_dropout: 0.0\nlora_target_modules: [to_q, to_v]\n"
        "reward_funcs: [brightness]\nprompts_file: prompts.txt\nnum_sample_images: 0\noutput_dir: run\nuse_cpu: true\n"
        "bf16: false\nmax_steps: 2\nlearning_rate: 0.01\nnum_generations: 2\ngeneration_batch_size: 4\n"
        "num_inference_steps: 4\ntimestep_fraction: 1.0\nheight: 32\nwidth: 32\nmax_sequence_length: 16\n"
        "per_device_train_batch_size: 6\ngradient_accumulation_steps: 2\nsave_strategy: steps\nsave_steps: 1\n"
        "report_to: none\n"
    )
    # Options the script does not know go to accelerate launch; the YAML's to the script.
    run("grpo", "--config", "grpo.yaml", "--num_processes", "1", "--mixed_precision", "no", "--seed", "3")
    assert (work / "run" / "checkpoint-1" / "pytorch_lora_weights.safetensors").is_file()
    assert json.loads((work / "run" / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2

    out = run(
        "eval", "--model_name_or_path", "tiny-flux", "--prompts_file", "prompts.txt",
        "--checkpoints", "run/checkpoint-1", "run", "tiny-flux/transformer", "--reward_funcs", "brightness", "--num_images_per_prompt", "2",
        "--max_sequence_length", "16", "--num_inference_steps", "4", "--output_dir", "eval",
    )  # fmt: skip
    # Without size flags a tiny pipeline samples at the size it was saved with, not FLUX's 1024² (steps given here).
    assert "a tiny pipeline: sampling defaults {'height': 32, 'width': 32, 'num_inference_steps': 8}" in out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    names = ["base", "run-checkpoint-1", "run", "tiny-flux-transformer"]
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == names
    assert "brightness win rate vs base" in rows[0] and (work / "eval" / "results.md").read_text().startswith(rows[0])
    dataset = load_dataset("imagefolder", data_dir=str(work / "eval"), split="train")
    assert len(dataset) == 4 * 8 and sorted(set(dataset["model"])) == sorted(names)
    assert dataset[0]["image"].size == (32, 32) and 0 <= dataset[0]["brightness"] <= 1
    # The base's own denoiser as a (full fine-tune) checkpoint: the same noise gives the same samples, so every pair
    # ties (win rate ½) and the rewards are the base's.
    by_model = {name: sorted((r["sample"], r["brightness"]) for r in dataset if r["model"] == name) for name in names}
    assert by_model["tiny-flux-transformer"] == by_model["base"] and rows[4].endswith("| 0.500 |")
    assert by_model["run"] != by_model["base"]  # the trained LoRA was applied
    report = run("env")
    assert "- trl-dance version: " in report and "- diffusers version: " in report and "- Accelerators: " in report
    assert run("tiny", "--help").startswith("usage: trl-dance tiny")


def test_one_method_table_feeds_exports_commands_and_the_script(tmp_path):
    """Every row of the method table is exported (lazily and for type checkers), is a ``trl-dance`` subcommand, and
    the one training script finds it from --command, the YAML's ``command:`` or the recipe file's name."""
    import ast

    import trl_dance
    from trl_dance.cli import _usage
    from trl_dance.methods import METHODS, get_method
    from trl_dance.scripts.train import resolve_method

    with open(trl_dance.__file__, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    checked = next(
        node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
    )
    typed = {alias.name for node in checked.body for alias in node.names}
    for method in METHODS.values():
        config, trainer = method.config_class, method.trainer_class
        assert getattr(trl_dance, config.__name__) is config and getattr(trl_dance, trainer.__name__) is trainer
        assert {config.__name__, trainer.__name__} <= typed & set(trl_dance.__all__)
        assert f"  {method.name} " in _usage()
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("command: nft\nlearning_rate: 1.0e-4\n")
    assert resolve_method(["--config", str(recipe)], "recipes/train.py").name == "nft"
    assert resolve_method(["--command", "spo"], "recipes/train.py").name == "spo"
    assert resolve_method([], "recipes/ddpo_sd.py").name == "grpo"
    assert resolve_method([], "recipes/online_dpo.py") is get_method("online-dpo")
    assert resolve_method([], "/x/recipes/dpo_sdxl.py").name == "dpo"
    with pytest.raises(ValueError, match="is a 'nft' recipe .*trl-dance nft"):
        resolve_method(["--command", "grpo", "--config", str(recipe)], "train.py")
    with pytest.raises(ValueError, match="which method"):
        resolve_method([], "recipes/train.py")
    with pytest.raises(ValueError, match="unknown method 'ppo': one of grpo, nft"):
        get_method("ppo")


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "trl_dance.cli", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_context_parallel_runs_start_through_the_cli(tiny_model_dir, tmp_path):
    """The launcher validates a config for the processes it starts, not for itself (one process refused every
    context_parallel_size > 1): two CPU processes splitting tiny Wan's sequence train through `trl-dance grpo`, and a
    process count the group size does not divide is refused before anything is launched."""
    recipe = ["grpo", "--config", "recipes/configs/grpo_wan_tiny.yaml", "--model_name_or_path", tiny_model_dir("wan")]
    common = ["--context_parallel_size", "2", "--max_steps", "1", "--num_sample_images", "0", "--multi_gpu"]
    refused = _run_cli(*recipe, *common, "--num_processes", "3", "--output_dir", str(tmp_path / "three"))
    assert refused.returncode != 0
    assert "context_parallel_size (2) must divide the number of processes (3)" in refused.stderr
    assert not (tmp_path / "three").exists()  # refused in the launcher, before any training process
    ran = _run_cli(
        *recipe, *common, "--num_processes", "2", "--output_dir", str(tmp_path / "two"), "--main_process_port", "29541"
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert (tmp_path / "two" / "pytorch_lora_weights.safetensors").exists()


def test_the_slurm_example_command_validates_for_its_sixteen_processes(monkeypatch):
    """recipes/slurm/grpo_wan22_cp.sbatch's `trl-dance` line as srun runs it on node 0 of 2: the launcher checks the
    recipe (context parallelism over 4 of 16 processes) and hands accelerate the multi-node options."""
    import re
    import shlex

    import accelerate.commands.launch

    from trl_dance import cli

    with open(os.path.join(ROOT, "recipes", "slurm", "grpo_wan22_cp.sbatch")) as handle:
        line = re.search(r"'(trl-dance grpo .*?)'", handle.read().replace("\\\n", " "), re.S).group(1)
    values = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    line = line.replace("$((SLURM_NNODES * 8))", "16")
    for name, value in values.items():
        line = line.replace(f'"${name}"', value).replace(f"${name}", value)
    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    assert cli.main([*shlex.split(line)[1:], "--bf16", "false", "--use_cpu", "true"]) == 0  # (no GPU here for bf16)
    (launch,) = launched
    assert (launch.num_machines, launch.num_processes, launch.machine_rank) == (2, 16, 0)
    assert launch.config_file == cli.accelerate_configs()["multinode"] and launch.main_process_ip == "10.0.0.1"
    assert "--context_parallel_size" not in launch.training_script_args  # the recipe's, read by the script itself


def test_user_errors_are_one_line_with_the_fix(tmp_path, capsys, monkeypatch):
    """A typo'd YAML key names the file and the field meant, a typo'd or abbreviated flag the flag meant; several GPU
    processes without --multi_gpu (which accelerate would run as one) are refused naming the flag; each is one line
    and exit status 2."""
    from trl_dance.cli import DEBUG_ENV

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    recipe = tmp_path / "typo.yaml"
    tiny = os.path.join(ROOT, "recipes", "configs", "grpo_flux_tiny.yaml")
    with open(tiny) as handle:
        recipe.write_text(handle.read() + "learning_rat: 0.1\n")
    assert main(["grpo", "--config", str(recipe)]) == 2
    error = capsys.readouterr().err
    assert f"{recipe}: unknown keys 'learning_rat' (did you mean 'learning_rate'?)" in error
    assert "Traceback" not in error and len(error.strip().splitlines()) == 2  # the message, how to see the traceback
    for typo, meant in (("--lerning_rate", "--learning_rate"), ("--learning_rat", "--learning_rate")):  # no prefixes
        assert main(["grpo", "--config", tiny, typo, "0.1"]) == 2
        error = capsys.readouterr().err
        assert f"unknown option {typo} (did you mean {meant}?)" in error and len(error.strip().splitlines()) == 2
    with monkeypatch.context() as gpus:  # with GPUs, --multi_gpu is for the user to say (on CPUs: test_multiprocess)
        gpus.setattr(torch.cuda, "is_available", lambda: True)
        assert main(["grpo", "--config", tiny, "--num_processes", "2"]) == 2
        assert (
            "would start one process (accelerate's single-process launcher): add --multi_gpu"
            in capsys.readouterr().err
        )
        gpus.setenv(DEBUG_ENV, "1")
        with pytest.raises(ValueError, match="would start one process"):
            main(["grpo", "--config", tiny, "--num_processes", "2"])
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("trl-dance 0.")
    monkeypatch.delenv(DEBUG_ENV)
    prompts = os.path.join(ROOT, "recipes", "data", "tiny_prompts.txt")
    monkeypatch.chdir(tmp_path)
    base = ["--model_name_or_path", "outputs/tiny-fluxx", "--prompts_file", prompts]  # a typo that looks like a Hub id
    assert main(["eval", *base, "--reward_funcs", "brightness"]) == 2  # as training says it, not "not cached"
    assert f"there is no such folder ({tmp_path / 'outputs' / 'tiny-fluxx'})" in capsys.readouterr().err


def test_module_rewards_resolve_from_the_working_directory_in_every_entry_point(tmp_path, monkeypatch):
    """`my_rewards:fn` beside the user imports in training, eval and serve-reward alike (they all resolve rewards
    through get_reward_function), and serve-reward takes its arguments in the trainers' {name: {...}} form too, as
    the offline hints write them."""
    from trl_dance.rewards import get_reward_function
    from trl_dance.rewards.server import served_reward

    (tmp_path / "my_rewards_here.py").write_text(
        "class Scaled:\n"
        "    def __init__(self, scale=1.0):\n"
        "        self.scale = scale\n"
        "    def __call__(self, prompts, images, **kwargs):\n"
        "        return [self.scale] * len(prompts)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert get_reward_function("my_rewards_here:Scaled")(["a"], None) == [1.0]
    assert served_reward("my_rewards_here:Scaled", '{"scale": 2.0}')(["a"], None) == [2.0]
    assert served_reward("my_rewards_here:Scaled", '{"my_rewards_here:Scaled": {"scale": 3.0}}')(["a"], None) == [3.0]


def test_help_is_fast_and_short_with_every_option_one_flag_away():
    """`trl-dance grpo --help` took ~7 s and 700+ lines, listed the internal --command and printed torchvision
    notices: now the common options without importing the trainers; --help_all is the script's full parser."""
    import time

    def run(*args):
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "trl_dance.cli", *args], capture_output=True, text=True, check=True, cwd=ROOT
        )
        return result.stdout, result.stderr, time.perf_counter() - start

    for command in ("grpo", "dpo"):
        out, err, seconds = run(command, "--help")
        assert out.startswith(f"usage: trl-dance {command} --config") and len(out.splitlines()) < 150, out
        assert seconds < 10 and "torch" not in err  # (< 0.2 s measured; the bound is for loaded CI machines)
        assert "--help_all" in out and "--command" not in out
    for command in ("eval", "serve-reward"):  # their usage names them; no reStructuredText markup
        out, _, _ = run(command, "--help")
        assert out.startswith(f"usage: trl-dance {command}") and "``" not in out and ":mod:" not in out
    full, err, _ = run("grpo", "--help_all")
    assert "--learning_rate" in full and "--sde_window_size" in full and "--command" not in full
    assert "requires torchvision" not in err  # transformers' PIL-fallback notice, silenced


def test_launched_runs_report_user_errors_in_one_line_and_print_no_launcher_notes(tiny_model_dir, tmp_path):
    """A user error the launched script finds (here, fewer prompts than a round uses) was two tracebacks after
    accelerate's note on the launch defaults, printed twice: now one line and exit status 2, and no note."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    recipe = os.path.join(ROOT, "recipes", "configs", "grpo_flux_tiny.yaml")
    result = subprocess.run(
        [sys.executable, "-m", "trl_dance.cli", "grpo", "--config", recipe, "--model_name_or_path",
         tiny_model_dir("flux"), "--prompts_file", str(prompts), "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("trl-dance grpo: error: train_dataset has 2 prompts but each round uses 8"), lines
    assert "Traceback" not in result.stderr and "were not passed to `accelerate launch`" not in result.stderr
