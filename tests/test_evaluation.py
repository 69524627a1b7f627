"""Evaluation: Diffusion-DPO's held-out loss and TRL metric names from fixed draws, its sample images, the evaluation
sampler's own settings, and a given reference model."""

import glob
import math

import pytest
import torch
from conftest import LORA_TARGETS, PROMPTS, tiny_dpo_config, tiny_grpo_config
from datasets import Dataset, IterableDataset
from diffusers import DiffusionPipeline
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer, DiffusionDPOTrainer
from trl_dance.testing import tiny_preference_dataset


def _dpo_config(tmp_path, **overrides):
    batches = {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 4, "logging_steps": 1}
    return tiny_dpo_config(tmp_path, **(batches | overrides))


def _lora():
    return LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS)


@pytest.fixture(scope="module")
def sd_pairs():
    return tiny_preference_dataset("sd", 10)


def test_dpo_evaluation_at_eval_steps_in_tensorboard(tiny_model_dir, tmp_path, sd_pairs, monkeypatch):
    """eval_dataset + eval_strategy: the held-out loss and TRL's DPO metric names at every eval_steps, in the
    TensorBoard run of the training metrics, with eval_prompts' images; at the LoRA's initialisation the policy is the
    reference: loss ln 2, accuracy ½, margin 0."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logs))
    evaluation = {"eval_strategy": "steps", "eval_steps": 1, "eval_prompts": PROMPTS[:2]}
    evaluation |= {"eval_num_inference_steps": 3, "report_to": "tensorboard"}
    trainer = DiffusionDPOTrainer(
        tiny_model_dir("sd"),
        args=_dpo_config(tmp_path, **evaluation),
        train_dataset=sd_pairs.select(range(8)),
        eval_dataset=sd_pairs.select(range(8, 10)),
        peft_config=_lora(),
    )
    assert trainer._eval_policy is None
    before = trainer.evaluate()
    assert before["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert before["eval_rewards/accuracies"] == 0.5 and before["eval_rewards/margins"] == 0.0
    # The pipeline's own defaults, with eval_num_inference_steps: SD1.5 samples with CFG 7.5.
    assert trainer._eval_policy.num_steps == 3 and trainer._eval_policy.settings.guidance_scale == 7.5
    assert trainer.policy.settings.guidance_scale == 1.0  # training still trains the conditional prediction

    trainer.train()
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [entry["step"] for entry in evals] == [1, 2]  # train() starts a new log history
    names = ("eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies", "eval_implicit_acc")
    assert all(name in entry for entry in evals for name in names)
    assert evals[-1]["eval_loss"] != before["eval_loss"]  # the policy moved
    train = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all("rewards/margins" in entry and "rewards/accuracies" in entry for entry in train)
    # Fixed draws: the same policy evaluates identically, whatever the batch size.
    trainer.args.per_device_eval_batch_size = 3
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)
    assert (tmp_path / "out" / "eval_samples_step2.png").exists()

    # The training run's event file (the evaluate() after train() opens a writer of its own).
    runs = [
        EventAccumulator(path, size_guidance={"images": 0})
        for path in glob.glob(str(logs / "**" / "events.*"), recursive=True)
    ]
    (events,) = [run for run in runs if run.Reload() and "train/loss" in run.Tags()["scalars"]]
    assert [event.step for event in events.Scalars("eval/loss")] == [0, 1, 2]  # before training, then eval_steps
    assert {"eval/rewards/accuracies", "train/rewards/margins"} <= set(events.Tags()["scalars"])
    assert [image.step for image in events.Images("eval/images")] == [0, 1, 2]


def test_dpo_evaluation_inputs_are_checked(tiny_model_dir, tmp_path, sd_pairs):
    with pytest.raises(ValueError, match="eval_strategy='steps' needs an eval_dataset or eval_prompts"):
        DiffusionDPOTrainer(
            tiny_model_dir("sd"), args=_dpo_config(tmp_path, eval_strategy="steps"), train_dataset=sd_pairs
        )
    with pytest.raises(ValueError, match="eval_dataset: a preference dataset needs the columns"):
        DiffusionDPOTrainer(
            tiny_model_dir("sd"),
            args=_dpo_config(tmp_path),
            train_dataset=sd_pairs,
            eval_dataset=Dataset.from_dict({"prompt": ["a"]}),
        )
    # A stream is read once; eval_prompts alone satisfy eval_strategy.
    stream = IterableDataset.from_generator(lambda: iter(sd_pairs.select(range(2))))
    trainer = DiffusionDPOTrainer(
        tiny_model_dir("sd"),
        args=_dpo_config(tmp_path, loss_type=["sft"]),
        train_dataset=sd_pairs,
        eval_dataset=stream,
    )
    metrics = trainer.evaluate()
    assert (
        set(metrics) - {"epoch"} == {"eval_loss"} and metrics["eval_loss"] > 0
    )  # sft: no reference, no reward metrics
    only_prompts = _dpo_config(tmp_path, eval_strategy="steps", eval_prompts=["a cat"], eval_num_inference_steps=2)
    trainer = DiffusionDPOTrainer(tiny_model_dir("sd"), args=only_prompts, train_dataset=sd_pairs)
    assert set(trainer.evaluate()) <= {"epoch"}  # images only
    assert (tmp_path / "out" / "eval_samples_step0.png").exists()
    rows = sd_pairs.to_dict()
    rows["rejected"][0] = None
    trainer = DiffusionDPOTrainer(
        tiny_model_dir("sd"), args=_dpo_config(tmp_path), train_dataset=sd_pairs, eval_dataset=Dataset.from_dict(rows)
    )
    with pytest.raises(ValueError, match="eval_dataset: 1 of rows .* have a missing image"):
        trainer.evaluate()


def test_given_reference_model(tiny_model_dir, tmp_path, sd_pairs):
    """ref_model replaces the disabled-adapter reference: a pipeline folder's denoiser, checked for its class."""
    args = _dpo_config(tmp_path, per_device_train_batch_size=4)
    base = DiffusionDPOTrainer(tiny_model_dir("sd"), args=args, train_dataset=sd_pairs, peft_config=_lora())
    # The same weights as reference: z = 0 exactly, as with the adapter disabled.
    given = DiffusionDPOTrainer(
        tiny_model_dir("sd"), tiny_model_dir("sd"), args=args, train_dataset=sd_pairs, peft_config=_lora()
    )
    assert given.ref_model is not None and given.ref_model is not given.policy.denoiser
    with torch.no_grad():
        metrics = given.evaluate(sd_pairs.select(range(4)))
    assert metrics["eval_rewards/margins"] == 0.0 and base.ref_model is None
    # Another denoiser as reference (a module): the margins move away from 0.
    other = DiffusionPipeline.from_pretrained(tiny_model_dir("sd")).unet
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.05)
    moved = DiffusionDPOTrainer(tiny_model_dir("sd"), other, args=args, train_dataset=sd_pairs, peft_config=_lora())
    assert moved.evaluate(sd_pairs.select(range(4)))["eval_rewards/margins"] != 0.0
    with pytest.raises(ValueError, match="ref_model must be a UNet2DConditionModel"):
        DiffusionDPOTrainer(tiny_model_dir("sd"), tiny_model_dir("sd3"), args=args, train_dataset=sd_pairs)


def test_grpo_evaluation_sampler_settings(tiny_model_dir, tmp_path):
    """eval_num_inference_steps / eval_guidance_scale build a second sampler on the same pipeline; without them
    evaluation samples with the training settings (the same policy object)."""
    prompts = Dataset.from_dict({"prompt": PROMPTS})
    plain = DanceGRPOTrainer(
        tiny_model_dir("sd3"), "brightness", args=tiny_grpo_config(tmp_path), train_dataset=prompts
    )
    first = plain.evaluate(prompts)
    assert plain._eval_policy is plain.policy
    args = tiny_grpo_config(tmp_path, eval_num_inference_steps=3, eval_guidance_scale=2.0)
    trainer = DanceGRPOTrainer(tiny_model_dir("sd3"), "brightness", args=args, train_dataset=prompts)
    second = trainer.evaluate(prompts)
    policy = trainer._eval_policy
    assert policy is not trainer.policy and policy.pipeline is trainer.policy.pipeline
    assert policy.num_steps == 3 and policy.settings.guidance_scale == 2.0 and trainer.policy.num_steps != 3
    assert second["eval_reward"] != first["eval_reward"]
    with pytest.raises(ValueError, match="eval_num_inference_steps must be >= 1"):
        tiny_grpo_config(tmp_path, eval_num_inference_steps=0)
    flux = DanceGRPOTrainer(
        tiny_model_dir("flux"),
        "brightness",
        args=tiny_grpo_config(tmp_path, eval_negative_prompt="blurry"),
        train_dataset=prompts,
    )
    with pytest.raises(ValueError, match="negative_prompt feeds the unconditional branch of CFG"):
        flux.evaluate(prompts)


def test_grpo_streams_an_iterable_dataset_in_groups(tiny_model_dir, tmp_path, monkeypatch):
    """As trl.GRPOTrainer: a streaming train_dataset (max_steps required) is read in rounds of whole groups, each
    prompt num_generations times; an IterableDataset evaluates too."""
    rows = [{"prompt": prompt} for prompt in PROMPTS * 3]
    stream = IterableDataset.from_generator(lambda: iter(rows))
    with pytest.raises(ValueError, match="a streaming \\(Iterable\\) train_dataset has no length: set max_steps > 0"):
        DanceGRPOTrainer(
            tiny_model_dir("flux"), "brightness", args=tiny_grpo_config(tmp_path, max_steps=-1), train_dataset=stream
        )
    trainer = DanceGRPOTrainer(
        tiny_model_dir("flux"), "brightness", args=tiny_grpo_config(tmp_path, max_steps=3), train_dataset=stream
    )
    rounds = []
    generate = trainer._generate_and_score
    monkeypatch.setattr(
        trainer, "_generate_and_score", lambda batch: rounds.append([r["prompt"] for r in batch]) or generate(batch)
    )
    trainer.train()
    size = trainer.args.num_generations
    assert len(rounds) == 3 and all(len(batch) == trainer.args.generation_batch_size for batch in rounds)
    for batch in rounds:
        groups = [batch[i : i + size] for i in range(0, len(batch), size)]
        assert all(len(set(group)) == 1 for group in groups) and len({g[0] for g in groups}) == len(groups)
    assert {prompt for batch in rounds for prompt in batch} <= set(PROMPTS)
    assert "eval_reward" in trainer.evaluate(IterableDataset.from_generator(lambda: iter(rows[:2])))


def test_eval_refuses_a_lora_of_another_model_and_samples_tiny_videos_at_their_saved_frames(tiny_model_dir, tmp_path):
    """`trl-dance eval` of an SD3 LoRA on a FLUX base once gave a win rate with only a peft warning: the LoRA's layers
    are checked against the base's denoiser first, and the error names the base its card gives. A tiny Wan folder
    carries its 5 frames (the pipeline's 81 exceed the tiny transformer's rotary table)."""
    from peft.utils import get_peft_model_state_dict

    from trl_dance.scripts.evaluate import main

    sd3 = DiffusionPipeline.from_pretrained(tiny_model_dir("sd3"))
    sd3.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]))
    lora = tmp_path / "sd3-lora"
    type(sd3).save_lora_weights(str(lora), transformer_lora_layers=get_peft_model_state_dict(sd3.transformer))
    (lora / "README.md").write_text("---\nbase_model: stabilityai/stable-diffusion-3.5-medium\n---\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    common = ["--prompts_file", str(prompts), "--reward_funcs", "brightness", "--num_inference_steps", "2"]
    with pytest.raises(ValueError, match="not trained for this FluxTransformer2DModel .*stable-diffusion-3.5-medium"):
        main(["--model_name_or_path", tiny_model_dir("flux"), "--checkpoints", str(lora), "--max_sequence_length",
              "16", "--output_dir", str(tmp_path / "flux"), *common])  # fmt: skip
    rewards = main(["--model_name_or_path", tiny_model_dir("sd3"), "--checkpoints", str(lora), "--output_dir",
                    str(tmp_path / "sd3"), *common])  # fmt: skip
    assert len(rewards) == 2 and rewards["base"].shape == (2, 1)
    videos = main(["--model_name_or_path", tiny_model_dir("wan"), "--max_sequence_length", "16", "--output_dir",
                   str(tmp_path / "wan"), *common])  # fmt: skip
    assert videos["base"].shape == (2, 1)


def test_eval_takes_an_unfinished_run_folder_as_its_checkpoints(tmp_path):
    """A run folder without weights of its own stands for its checkpoint-<N> folders, by step; with weights, itself."""
    from trl_dance.lora import LORA_WEIGHTS_NAME
    from trl_dance.scripts.evaluate import _expand_run_folders

    run = tmp_path / "run"
    for step in (10, 2):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    assert _expand_run_folders([str(run)]) == [str(run / "checkpoint-2"), str(run / "checkpoint-10")]
    (run / LORA_WEIGHTS_NAME).write_bytes(b"")
    assert _expand_run_folders([str(run), str(run / "checkpoint-2")]) == [str(run), str(run / "checkpoint-2")]
