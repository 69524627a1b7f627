"""Run by tests/test_rollout_backprop.py under `accelerate launch` with 2 processes: two rounds of LoRA GRPO on a
tiny FLUX, the standard path then rollout_backprop, from the same initial LoRA; the main process saves the trained
parameters of each (start.pt, standard.pt, backprop.pt) to argv[2]."""

import os
import sys

import torch
from conftest import tiny_grpo_config  # (this script's folder, tests/, is on the path)
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer

model_dir, output_dir = sys.argv[1:3]
torch.set_num_threads(1)


def train(name: str, rollout_backprop: bool) -> DanceGRPOTrainer:
    args = tiny_grpo_config(  # 4 samples per process (groups across the two), one update per round
        os.path.join(output_dir, name), per_device_train_batch_size=4, max_steps=2, optim="sgd", learning_rate=300.0,
        lr_scheduler_type="constant", logging_steps=10, seed=3, rollout_backprop=rollout_backprop,
    )  # fmt: skip
    peft = LoraConfig(
        r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights="gaussian"
    )
    dataset = Dataset.from_dict({"prompt": ["a cat", "a dog", "a red house", "blue sky"]})
    trainer = DanceGRPOTrainer(model_dir, "brightness", args=args, train_dataset=dataset, peft_config=peft)
    if not rollout_backprop:
        save(trainer, "start")
    trainer.train()
    save(trainer, name)
    return trainer


def save(trainer: DanceGRPOTrainer, name: str) -> None:
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.save(params, os.path.join(output_dir, f"{name}.pt"))


train("standard", False)
train("backprop", True)
