"""The job of the methods that learn from a dataset of images (Diffusion-DPO on preference pairs, SFT on captioned
images): the dataset in, a trained LoRA or denoiser out. Run through :mod:`trl_dance.scripts.train`.

Data: a Hub dataset or local folder (dataset_name) in TRL's preference format (prompt, chosen, rejected images) or
Pick-a-Pic's (caption, jpg_0, jpg_1, label_0); images are decoded per batch. Writes the LoRA
(pytorch_lora_weights.safetensors, for Pipeline.load_lora_weights) or the full denoiser to output_dir.
"""

import os
from dataclasses import dataclass, field

import torch
from trl import ModelConfig, get_peft_config

from trl_dance.data import load_any_dataset
from trl_dance.recipe_args import finish, model_init_kwargs, stopped_early
from trl_dance.trainer.diffusion_trainer import DiffusionTrainer
from trl_dance.visualization import save_image_grid, save_reward_curve


@dataclass
class ScriptArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "Hub id, save_to_disk folder or data file."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split of held-out pairs, evaluated when eval_strategy is not 'no'."}
    )
    dataset_streaming: bool = field(
        default=False, metadata={"help": "Stream the dataset (e.g. Pick-a-Pic's 850k pairs) instead of preparing it."}
    )
    shuffle_buffer_size: int = field(default=10_000, metadata={"help": "Rows shuffled together when streaming."})
    sample_prompts: list[str] = field(
        default_factory=list, metadata={"help": "Prompts of the before/after samples.png (none: no samples)."}
    )
    sample_steps: int = field(default=20, metadata={"help": "Denoising steps of the samples."})


def main(
    script_args: ScriptArguments, training_args, model_args: ModelConfig, trainer_class: type[DiffusionTrainer]
) -> DiffusionTrainer:
    if script_args.dataset_name is None:
        raise ValueError("--dataset_name is required")
    # Arrow-backed and memory-mapped (a large dataset such as Pick-a-Pic is not loaded into memory), or streamed.
    dataset = load_any_dataset(
        script_args.dataset_name,
        script_args.dataset_config,
        script_args.dataset_train_split,
        streaming=script_args.dataset_streaming,
    )
    if script_args.dataset_streaming:
        dataset = dataset.shuffle(seed=training_args.seed, buffer_size=script_args.shuffle_buffer_size)
    eval_dataset = None
    if training_args.eval_strategy != "no" and not training_args.eval_prompts:  # TRL's scripts: the test split
        eval_dataset = load_any_dataset(
            script_args.dataset_name, script_args.dataset_config, script_args.dataset_test_split
        )
    model_init_kwargs(training_args, model_args)
    trainer = trainer_class(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    before = _samples(trainer, script_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if stopped_early(trainer):  # preempted: its checkpoint is the run's state, nothing final-looking is written
        finish(trainer)
        return trainer
    trainer.save_model(training_args.output_dir)
    after = _samples(trainer, script_args)
    if trainer.accelerator.is_main_process:
        output_dir = training_args.output_dir
        if any("implicit_acc" in entry for entry in trainer.state.log_history):  # none in sft mode
            accuracy = save_reward_curve(
                trainer.state.log_history,
                os.path.join(output_dir, "implicit_accuracy.png"),
                "implicit accuracy",
                "implicit_acc",
            )
            print(
                f"implicit accuracy: first log {accuracy[0]:.3f}, last log {accuracy[-1]:.3f} ({len(accuracy)} logs)"
            )
        if before is not None:
            path = os.path.join(output_dir, "samples.png")
            save_image_grid(
                [before, after], path, size=128, row_labels=["before", "after"], captions=script_args.sample_prompts
            )
            trainer.save_samples(script_args.sample_prompts, after)
        print(f"wrote {output_dir}: {sorted(os.listdir(output_dir))}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    finish(trainer)
    return trainer


def _samples(trainer: DiffusionTrainer, script_args: ScriptArguments):
    """The pipeline's own samples of ``sample_prompts`` with the current denoiser (its LoRA, if any, on), fixed seeds;
    (B, 3, H, W) in [0, 1] (videos: (B, F, 3, H, W) of the trained clip length), or None without prompts."""
    if not script_args.sample_prompts:
        return None
    resolution, policy = trainer.args.resolution, trainer.policy
    video = {"num_frames": policy.settings.num_frames} if policy.is_video else {}
    with torch.no_grad():
        output = policy.pipeline(
            script_args.sample_prompts,
            num_inference_steps=script_args.sample_steps,
            height=resolution,
            width=resolution,
            generator=[torch.Generator().manual_seed(i) for i in range(len(script_args.sample_prompts))],
            output_type="pt",
            **video,
        )
    return (output.frames if video else output.images).float().cpu()
