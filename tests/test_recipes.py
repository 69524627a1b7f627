import dataclasses
import os
import subprocess
import sys

import pytest
import yaml
from PIL import Image

from trl_dance import DanceGRPOConfig
from trl_dance.methods import get_method
from trl_dance.trainer.dataset_config import DatasetTrainingConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_recipe(script: str, config: str, *arguments: str) -> subprocess.CompletedProcess:
    """``python recipes/<script>.py --config recipes/configs/<config>.yaml <arguments>`` offline; must succeed."""
    command = [
        sys.executable,
        os.path.join(ROOT, "recipes", f"{script}.py"),
        "--config",
        os.path.join(ROOT, "recipes", "configs", f"{config}.yaml"),
        *arguments,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _real_image_rows(tmp_path) -> list[str]:
    """``--prompts_file`` (a .jsonl of the tiny prompts, each with an image path relative to the repository, where the
    recipes run) and ``--gan_generator_weight``."""
    import json

    with open(os.path.join(ROOT, "recipes", "data", "tiny_prompts.txt")) as handle:
        prompts = [line.strip() for line in handle if line.strip()]
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as handle:
        for i, prompt in enumerate(prompts):
            path = tmp_path / f"real{i}.png"
            Image.new("RGB", (40, 48), (240, 200 - 10 * (i % 8), 30)).save(path)
            handle.write(json.dumps({"prompt": prompt, "image": os.path.relpath(path, ROOT)}) + "\n")
    return ["--prompts_file", str(rows), "--gan_generator_weight", "0.1"]


@pytest.mark.parametrize(
    ("script", "config", "kind"),
    [
        ("grpo_flux", "grpo_flux_tiny", "flux"),
        ("grpo_sd3", "grpo_sd3_tiny", "sd3"),
        ("grpo_sd3", "grpo_sd3_fast_tiny", "sd3"),
        ("grpo_flux", "grpo_flux_mix_tiny", "flux"),
        ("nft", "nft_flux_tiny", "flux"),
        ("nft", "art_z_image_turbo_tiny", "z-image"),
        ("dmd", "dmd_flux_tiny", "flux"),
        ("direct", "srpo_flux_tiny", "flux"),
        ("nft", "nft_wan_tiny", "wan"),
        ("grpo_sd", "grpo_sd_tiny", "sd"),
        ("ddpo_sd", "ddpo_sd_tiny", "sd"),
        ("grpo_wan", "grpo_wan_tiny", "wan"),
        ("grpo", "grpo_qwen_image_tiny", "qwen-image"),
        ("grpo", "grpo_hunyuan_video_tiny", "hunyuan-video"),
        ("grpo", "grpo_flux2_tiny", "flux2"),
        ("grpo", "grpo_flux2_klein_tiny", "flux2-klein"),
        ("grpo", "grpo_hunyuan_video15_tiny", "hunyuan-video15"),
        ("grpo", "grpo_minimax_h3_tiny", "minimax-h3"),
        ("spo", "spo_sd_tiny", "sd"),
        ("online_dpo", "online_dpo_sd3_tiny", "sd3"),
    ],
)
def test_tiny_recipe_runs_from_yaml_with_cli_overrides(tiny_model_dir, tmp_path, script, config, kind):
    """The README's main job, shortened: the real script, the shipped YAML, command-line overrides. DMD runs with its
    GAN head on a .jsonl of prompts and image paths relative to the working directory (its documented form)."""
    output_dir = tmp_path / "out"
    extra = _real_image_rows(tmp_path) if script == "dmd" else []
    result = _run_recipe(
        script,
        config,
        "--model_name_or_path", tiny_model_dir(kind), "--output_dir", str(output_dir), "--max_steps", "3",
        "--num_sample_images", "2", *extra,
    )  # fmt: skip
    assert "reward: first step" in result.stdout
    if script == "dmd":
        assert "'dmd/gan_discriminator_loss'" in result.stdout, result.stdout[-2000:]
    for name in ("pytorch_lora_weights.safetensors", "reward_curve.png", "samples.png"):
        assert (output_dir / name).exists(), name
    strip = 4 if kind in ("wan", "hunyuan-video", "hunyuan-video15", "minimax-h3") else 1  # videos: 4-frame strips
    # Two columns of 128-pixel pictures with a gap, a label column (before / after), a caption row (the prompts).
    assert Image.open(output_dir / "samples.png").size == (56 + 2 * 128 * strip + 6, 2 * 128 + 6 + 30)


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "recipes", "configs"))))
def test_shipped_configs_are_valid(name, tmp_path):
    """Every training field of every shipped YAML is a DanceGRPOConfig field and passes its checks."""
    with open(os.path.join(ROOT, "recipes", "configs", name)) as handle:
        values = yaml.safe_load(handle)
    from trl_dance.recipe_args import USED_MODEL_FIELDS
    from trl_dance.trainer.context_parallel import planned_world_size

    script_and_model_keys = {
        *USED_MODEL_FIELDS,
        "reward_funcs",
        "prompts_file",
        "eval_prompts_file",
        "dataset_name",
        "num_sample_images",
        "dataset_streaming",
        "shuffle_buffer_size",
        "sample_prompts",
        "sample_steps",
    }
    config_class = get_method(values["command"]).config_class  # every shipped recipe names its command
    training = {k: v for k, v in values.items() if k not in {*script_and_model_keys, "command"}}
    # Validated for the processes they run on, as `trl-dance` validates them before launching: the GPU recipes on one
    # 8-GPU node (the 2-node SLURM example's on 16), context parallelism included.
    world = 1 if values.get("use_cpu") else 16 if name == "grpo_wan22_81f_cp.yaml" else 8
    training.update(output_dir=str(tmp_path), use_cpu=True, bf16=False, fp16=False, report_to="none")
    with planned_world_size(world):
        config = config_class(**training)
    assert values.get("lora_dropout", 0.0) == 0.0
    assert isinstance(config, DatasetTrainingConfig) or config.steps_per_generation >= 1
    if "pipeline_class" in values:
        import diffusers

        pipeline_class = getattr(diffusers, values["pipeline_class"])
        assert issubclass(pipeline_class, (diffusers.DiffusionPipeline, diffusers.ModularPipeline))
    if "train_expert" in values:
        # The tiny two-expert Wan has Wan 2.2's boundary (0.875 of 1000): the same steps fall to each expert.
        from trl_dance.policies import SamplerSettings, make_policy
        from trl_dance.testing import tiny_wan22_pipeline

        # Which steps each expert serves depends on the schedule only: the tiny transformer at a tiny size.
        settings = dataclasses.replace(SamplerSettings.from_config(config), height=32, width=32, num_frames=5)
        policy = make_policy(tiny_wan22_pipeline(), settings)
        assert config.timesteps_per_sample <= len(policy.trainable_steps())


@pytest.mark.parametrize(
    ("kind", "script", "config", "strip"),
    [
        ("wan-i2v", "grpo_wan", "grpo_wan_i2v_tiny", 4),
        ("flux-kontext", "grpo", "grpo_flux_kontext_tiny", 1),
        ("skyreels-i2v", "grpo", "grpo_skyreels_i2v_tiny", 4),
    ],
)
def test_tiny_image_conditioned_recipe_reads_image_paths(tmp_path, kind, script, config, strip):
    """Image-to-video and editing from a prompts.jsonl whose image column holds file paths, as real runs give it."""
    from trl_dance.testing import main as testing_main

    testing_main([kind, str(tmp_path / "tiny"), "--image-prompts", str(tmp_path / "prompts")])
    result = _run_recipe(
        script,
        config,
        "--model_name_or_path", str(tmp_path / "tiny"),
        "--prompts_file", str(tmp_path / "prompts" / "prompts.jsonl"),
        "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--num_sample_images", "2",
    )  # fmt: skip
    assert "reward: first step" in result.stdout
    assert Image.open(tmp_path / "out" / "samples.png").size == (56 + 2 * strip * 128 + 6, 2 * 128 + 6 + 30)
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").exists()


@pytest.mark.parametrize(
    ("kind", "config", "strip"), [("sd3", "dpo_sd3_tiny", 1), ("wan", "dpo_wan_tiny", 4), ("sd3", "sft_sd3_tiny", 1)]
)
def test_tiny_dpo_recipe_runs_from_yaml(tmp_path, kind, config, strip):
    """Image pairs (SD3) and video pairs (Wan, lists of frames saved with save_to_disk) through the real script; SFT
    on the pairs' chosen images (a Diffusion-DPO recipe's SFT phase)."""
    from trl_dance.testing import main as testing_main

    testing_main([kind, str(tmp_path / "tiny"), "--preferences", str(tmp_path / "prefs")])
    command = config.split("_")[0]
    result = _run_recipe(
        command,
        config,
        "--model_name_or_path", str(tmp_path / "tiny"), "--dataset_name", str(tmp_path / "prefs"),
        "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--logging_steps", "1",
        "--sample_prompts", "a cat", "a dog", "--sample_steps", "3",
        # as the real DPO configs load data: in persistent worker processes
        "--dataloader_num_workers", "2", "--dataloader_persistent_workers", "true",
    )  # fmt: skip
    dpo = command == "dpo"
    assert ("implicit accuracy: first log" in result.stdout) == dpo and f"wrote {tmp_path / 'out'}" in result.stdout
    for name in ("pytorch_lora_weights.safetensors", "samples.png", "image_1.png", *(["implicit_accuracy.png"] * dpo)):
        assert (tmp_path / "out" / name).exists(), name
    assert Image.open(tmp_path / "out" / "samples.png").size == (56 + 2 * strip * 128 + 6, 2 * 128 + 6 + 30)


def test_model_card_is_a_diffusers_card(tiny_model_dir, tmp_path, monkeypatch):
    """The card push_to_hub uploads: diffusers metadata, TRL-style tags, a loading snippet that works as written."""
    monkeypatch.delenv("JOB_ID", raising=False)
    from datasets import Dataset
    from diffusers import DiffusionPipeline
    from peft import LoraConfig

    from trl_dance import DanceGRPOTrainer

    args = DanceGRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        num_generations=2,
        generation_batch_size=2,
        num_inference_steps=3,
        height=32,
        width=32,
        max_sequence_length=16,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=1,
        disable_tqdm=True,
    )
    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"),
        ["brightness", "jpeg_compressibility"],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a cat", "a dog"]}),
        peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
    )
    trainer.train()
    trainer.save_model()
    trainer.create_model_card(dataset_name="my/prompts", tags=["my-tag"])
    card = (tmp_path / "out" / "README.md").read_text()
    header = yaml.safe_load(card.split("---")[1])
    assert header["library_name"] == "diffusers" and header["pipeline_tag"] == "text-to-image"
    assert {"trl", "trl-dance", "dance-grpo", "lora", "my-tag"} <= set(header["tags"])
    assert header["datasets"] == ["my/prompts"]
    assert "brightness × 1, jpeg_compressibility × 1" in card and "arXiv:2505.07818" in card
    assert "hf_jobs" not in header["tags"] and "W&B" not in card
    snippet = card.split("```python")[1].split("```")[0]
    namespace = {}
    exec(snippet, namespace)  # loads the base pipeline and the LoRA from the local folders
    assert isinstance(namespace["pipeline"], DiffusionPipeline)

    # What TRL's cards carry: the run's tracker pages (through TRL's helpers) and the Hugging Face Jobs tag.
    import trl.trainer.utils

    space = "https://me-dash.hf.space?project=p&runs=r&sidebar=collapsed"
    monkeypatch.setenv("JOB_ID", "42")
    monkeypatch.setattr(trl.trainer.utils, "get_trackio_space_url", lambda: space)
    monkeypatch.setattr(trl.trainer.utils, "get_comet_experiment_url", lambda: "https://comet.com/me/x/1")
    trainer.create_model_card(tags=["trackio:https://stale.hf.space"])
    card = (tmp_path / "out" / "README.md").read_text()
    tags = set(yaml.safe_load(card.split("---")[1])["tags"])
    assert {"hf_jobs", f"trackio:{space}"} <= tags and "trackio:https://stale.hf.space" not in tags
    assert f"- Trackio: [{space}]({space})" in card and "- Comet experiment: [https://comet.com/me/x/1]" in card


def test_push_to_hub_uploads_the_lora_card_and_samples(tiny_model_dir, tmp_path, monkeypatch):
    """The recipe with --push_to_hub: the folder handed to the Hub upload holds the diffusers LoRA, a card naming
    the base model, trainer, rewards, dataset and tags, and the sample grid. Only the two network calls are stubbed."""
    import types

    import transformers.trainer
    from safetensors.torch import load_file

    from trl_dance.scripts import train

    uploads = []

    class FakeHubApi:
        def create_repo(self, repo_id, **kwargs):
            return types.SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, repo_id, folder_path, **kwargs):
            files = {name: os.path.join(folder_path, name) for name in os.listdir(folder_path)}
            with open(files["README.md"]) as card:
                uploads.append({"repo_id": repo_id, "files": files, "card": card.read()})

    monkeypatch.setattr(transformers.trainer, "hf_api", FakeHubApi)
    output_dir = tmp_path / "out"
    argv = [
        "--config", os.path.join(ROOT, "recipes", "configs", "grpo_flux_tiny.yaml"),
        "--model_name_or_path", tiny_model_dir("flux"), "--output_dir", str(output_dir), "--max_steps", "1",
        "--num_sample_images", "2", "--push_to_hub", "true", "--hub_model_id", "me/tiny-flux-grpo",
    ]  # fmt: skip
    train.main(argv)

    # As in TRL's recipes: save_model pushes ("Model save"), then the final push adds the dataset and samples.
    upload = uploads[-1]
    assert upload["repo_id"] == "me/tiny-flux-grpo"
    assert {"pytorch_lora_weights.safetensors", "README.md", "samples.png"} <= set(upload["files"])
    assert load_file(upload["files"]["pytorch_lora_weights.safetensors"])  # a non-empty diffusers LoRA
    header = yaml.safe_load(upload["card"].split("---")[1])
    assert {"trl", "dance-grpo", "lora"} <= set(header["tags"]) and header["library_name"] == "diffusers"
    card = upload["card"]
    assert "DanceGRPO" in card and "brightness" in card and "](samples.png)" in card
    assert "pipeline.load_lora_weights('me/tiny-flux-grpo')" in card


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_threads_wait_passively_unless_the_user_says_otherwise(given, expected):
    """Spinning OpenMP threads slowed tiny runs 4-8x on a loaded 2-core machine: the entry points (the trl-dance
    command, the training script) and `import trl_dance` before torch make them wait passively (without the
    environment's .pth too: tests/test_speed_options.py); a value the user set is kept."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    code = "import {}, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    run = lambda module: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code.format(module)], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert run("trl_dance.cli") == expected
    assert run("trl_dance, torch") == expected
    with open(os.path.join(ROOT, "trl_dance", "scripts", "train.py")) as handle:
        recipe = handle.read()
    assert recipe.index('os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")') < recipe.index("from trl import")


def test_recipe_arguments_name_config_refuse_unused_model_fields_and_import_rewards_from_cwd(tmp_path, monkeypatch):

    from trl_dance.recipe_args import USAGE, parse_recipe_args
    from trl_dance.rewards import get_reward_function
    from trl_dance.scripts import train

    config = os.path.join(ROOT, "recipes", "configs", "grpo_flux_tiny.yaml")
    assert USAGE.startswith("%(prog)s --config FILE.yaml")
    types = train._types(get_method("grpo"))
    with pytest.raises(ValueError, match="do not use load_in_4bit=True .* remove them"):
        parse_recipe_args(types, ["--config", config, "--load_in_4bit", "true"])
    (tmp_path / "my_rewards.py").write_text("def redness(prompts, images, **kw):\n    return [1.0] * len(prompts)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    command, _, training, model = parse_recipe_args(types, ["--config", config])
    assert command.command == "grpo"
    assert model.model_name_or_path == "outputs/tiny-flux" and training.num_generations == 4
    assert get_reward_function("my_rewards:redness")(["a"], None) == [1.0]


def test_recipe_evaluates_held_out_prompts(tiny_model_dir, tmp_path):
    """--eval_prompts_file with eval_strategy: the held-out prompts are scored at eval_steps and their grid written."""
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("a blue car\na small boat\n")
    output_dir = tmp_path / "out"
    result = _run_recipe(
        "nft",
        "nft_flux_tiny",
        "--model_name_or_path", tiny_model_dir("flux"), "--output_dir", str(output_dir), "--max_steps", "2",
        "--num_sample_images", "0", "--eval_prompts_file", str(held_out), "--eval_strategy", "steps",
        "--eval_steps", "2",
    )  # fmt: skip
    assert "'eval_reward'" in result.stdout
    assert (output_dir / "eval_samples_step2.png").exists()
