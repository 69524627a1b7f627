"""The three private functions of other libraries trl-dance relies on, each pinned: when a release renames one or
changes what it takes or does, these fail naming it, before a user's run does (each has no public route today)."""

import inspect

import pytest
import torch


def test_diffusers_save_lora_weights_keeps_its_contract(tmp_path):
    """`LoraBaseMixin._save_lora_weights` writes the LoRA of a pipeline without diffusers' LoRA loader (HunyuanVideo
    1.5 in diffusers 0.42): `trl_dance.lora.save_lora` calls it with per-component layers and metadata."""
    from diffusers.loaders.lora_base import LoraBaseMixin
    from safetensors.torch import load_file

    save = getattr(LoraBaseMixin, "_save_lora_weights", None)
    assert save is not None, (
        "diffusers removed LoraBaseMixin._save_lora_weights: trl_dance.lora.save_lora needs a route"
    )
    parameters = list(inspect.signature(save).parameters)
    assert parameters[:3] == ["save_directory", "lora_layers", "lora_metadata"], parameters
    assert "safe_serialization" in parameters, parameters
    layers = {"transformer": {"blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 3)}}
    metadata = {"transformer": {"r": 2, "lora_alpha": 4}}
    save(str(tmp_path), layers, metadata, safe_serialization=True)
    saved = load_file(str(tmp_path / "pytorch_lora_weights.safetensors"))
    assert list(saved) == ["transformer.blocks.0.attn.to_q.lora_A.weight"]


def test_accelerate_validate_launch_command_resolves_the_options():
    """`accelerate.commands.launch._validate_launch_command` fills the launch options in from the config and its
    defaults: `trl_dance.cli.resolved_launch` reads the process count from its first result."""
    from accelerate.commands import launch

    validate = getattr(launch, "_validate_launch_command", None)
    assert validate is not None, "accelerate removed _validate_launch_command: trl_dance.cli.resolved_launch needs it"
    from trl_dance.cli import resolved_launch

    args = launch.launch_command_parser().parse_args(["--num_processes", "1", "--cpu", "script.py"])
    resolved = resolved_launch(args)
    assert resolved.num_processes == 1 and resolved.training_script == "script.py"


def test_accelerate_launcher_still_terminates_through_the_function_trl_dance_replaces():
    """`trl-dance` keeps a preempted script alive until its checkpoint is written by replacing
    `accelerate.commands.launch._terminate_process_tree` while it launches (accelerate's SIGKILLs after 5 s); the
    single-process launcher must still call that module-level name, or the replacement silently does nothing."""
    from accelerate.commands import launch

    assert callable(getattr(launch, "_terminate_process_tree", None)), "accelerate removed _terminate_process_tree"
    callers = [
        name
        for name, function in inspect.getmembers(launch, inspect.isfunction)
        if function.__module__ == launch.__name__
        and "_terminate_process_tree(" in inspect.getsource(function)
        and name != "_terminate_process_tree"
    ]
    if not callers:
        pytest.fail(
            "no function of accelerate.commands.launch calls _terminate_process_tree any more: see trl_dance.cli"
        )
