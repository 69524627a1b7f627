"""The job of the methods that learn from their own rollouts (GRPO, NFT, online DPO, SPO, Direct-Align): prompts in,
samples scored by ``reward_funcs``, a trained LoRA or denoiser out. Run through :mod:`trl_dance.scripts.train`.

Writes to output_dir: the LoRA (pytorch_lora_weights.safetensors, for Pipeline.load_lora_weights) or the full
denoiser, reward_curve.png, and samples.png (top row: before training, bottom row: after, same seeds).
"""

import os
from dataclasses import dataclass, field

from trl import ModelConfig, get_peft_config

from trl_dance.data import load_prompt_dataset
from trl_dance.recipe_args import finish, model_init_kwargs, stopped_early
from trl_dance.trainer.rollout_config import RolloutConfig
from trl_dance.trainer.rollout_trainer import RolloutTrainer
from trl_dance.visualization import save_image_grid, save_reward_curve


@dataclass
class ScriptArguments:
    reward_funcs: list[str] = field(
        default_factory=lambda: ["brightness"],
        metadata={"help": "Registered reward names or 'module.path:function'; weights in reward_weights."},
    )
    prompts_file: str | None = field(
        default=None, metadata={"help": "Local .txt (one prompt per line) or .jsonl/.csv."}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset with prompts (if no prompts_file)."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column holding the prompts."})
    num_sample_images: int = field(
        default=4, metadata={"help": "Prompts in the before/after sample grid, held-out ones first (0: none)."}
    )
    eval_prompts_file: str | None = field(
        default=None,
        metadata={"help": "Held-out prompts (.txt/.jsonl/.csv) scored at eval_steps with the deterministic sampler."},
    )


def main(
    script_args: ScriptArguments,
    training_args: RolloutConfig,
    model_args: ModelConfig,
    trainer_class: type[RolloutTrainer],
) -> RolloutTrainer:
    dataset = load_prompt_dataset(
        script_args.prompts_file,
        script_args.dataset_name,
        script_args.dataset_config,
        script_args.dataset_train_split,
        script_args.prompt_column,
    )
    eval_dataset = None
    if script_args.eval_prompts_file:
        eval_dataset = load_prompt_dataset(script_args.eval_prompts_file, prompt_column=script_args.prompt_column)
    model_init_kwargs(training_args, model_args)
    trainer = trainer_class(
        model=model_args.model_name_or_path,
        reward_funcs=script_args.reward_funcs,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    # The before/after grid shows held-out prompts when there are some (image-to-video: their images too).
    samples = (eval_dataset or dataset)[: script_args.num_sample_images]
    sample_prompts = samples["prompt"]
    conditions = {name: samples[name] for name in trainer.policy.condition_columns}
    before = trainer.generate_images(sample_prompts, **conditions) if sample_prompts else None

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if stopped_early(trainer):  # preempted: its checkpoint is the run's state, nothing final-looking is written
        finish(trainer)
        return trainer
    trainer.save_model(training_args.output_dir)

    after = trainer.generate_images(sample_prompts, **conditions) if sample_prompts else None
    if trainer.accelerator.is_main_process:
        output_dir = training_args.output_dir
        rewards = save_reward_curve(
            trainer.state.log_history,
            os.path.join(output_dir, "reward_curve.png"),
            title=" + ".join(trainer.reward_names),
        )
        print(f"reward: first step {rewards[0]:.4f}, last step {rewards[-1]:.4f} ({len(rewards)} rollouts)")
        evaluations = [entry for entry in trainer.state.log_history if "eval_reward" in entry]
        if len(evaluations) > 1:  # e.g. eval_on_start and a last evaluation: the held-out scores before and after
            first, last = evaluations[0], evaluations[-1]
            print(f"held-out evaluation, step {first['step']} -> step {last['step']}:")
            for key in sorted(k for k in last if k.startswith("eval_") and k in first and not k.endswith("std")):
                if not key.startswith(("eval_runtime", "eval_samples_per", "eval_steps_per")):
                    print(f"  {key[5:]}: {first[key]:.4f} -> {last[key]:.4f}")
        if before is not None:
            save_image_grid(
                [before, after],
                os.path.join(output_dir, "samples.png"),
                size=128,
                row_labels=["before", "after"],
                captions=sample_prompts,
            )
            trainer.save_samples(sample_prompts, after)  # image_<i>.png, the model card's widget gallery
        print(f"wrote {output_dir}: {sorted(os.listdir(output_dir))}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    finish(trainer)
    return trainer
