"""Run by tests/test_multiprocess.py under `accelerate launch`: GRPO rounds on a tiny pipeline, then write the
gathered rewards and advantages of each round and the logged metrics (main process) to argv[3] as JSON and save the
LoRA to argv[2]. Beside brightness, a group-wise reward that abstains on prompts without "a " and logs a metric.
With argv[4] ("local", or a `trl-dance serve-rollouts` URL): 2 rounds (8 updates), sampled in process or by the worker."""

import json
import sys

import torch
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOConfig, DanceGRPOTrainer

model_dir, output_dir, result_path = sys.argv[1:4]
workers = {} if len(sys.argv) < 5 else {"max_steps": 8}
if len(sys.argv) > 4 and sys.argv[4] != "local":
    workers["rollout_server_urls"] = [sys.argv[4]]
torch.set_num_threads(1)
args = DanceGRPOConfig(
    output_dir=output_dir,
    use_cpu=True,
    bf16=False,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    num_generations=4,
    generation_batch_size=8,
    num_inference_steps=6,
    height=32,
    width=32,
    max_sequence_length=16,
    per_device_train_batch_size=5,
    gradient_accumulation_steps=1,
    timestep_fraction=1.0,
    eta=1.0,
    learning_rate=1e-3,
    logging_steps=1,
    seed=7,
    **({"max_steps": 2} | workers),
)
dataset = Dataset.from_dict({"prompt": ["a cat", "a dog", "a red house", "blue sky"]})


def cats(prompts, images, log_metric, **kwargs):
    log_metric("cats/scored", float("a " in prompts[0]))  # one call per group: all or none of it scored
    return [float(image[0].mean()) if "a " in prompt else None for prompt, image in zip(prompts, images)]


cats.groupwise = True
trainer = DanceGRPOTrainer(
    model_dir,
    ["brightness", cats],
    args=args,
    train_dataset=dataset,
    peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
)
rollouts = []
original = trainer._generate_and_score


def recording(rows):
    original(rows)
    gathered = trainer.accelerator.gather_for_metrics
    rollouts.append(
        {
            "prompts": gathered(trainer._rollout["prompts"]),
            "rewards": gathered(trainer._rollout["rewards"]).tolist(),
            "advantages": gathered(trainer._rollout["advantages"]).tolist(),
        }
    )


trainer._generate_and_score = recording
trainer.train()
trainer.save_model(output_dir)  # every process calls it; only the main process writes
if trainer.accelerator.is_main_process:
    with open(result_path, "w") as handle:
        logged = [
            {k: v for k, v in entry.items() if k.startswith(("cats", "rewards/cats"))}
            for entry in trainer.state.log_history
        ]
        json.dump({"num_processes": trainer.accelerator.num_processes, "rounds": rollouts, "logged": logged}, handle)
trainer.accelerator.wait_for_everyone()  # no process exits while another still talks to it
trainer.accelerator.end_training()
