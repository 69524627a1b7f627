"""Run by tests/test_multiprocess.py under `accelerate launch` with two processes: GRPO for 6 rounds over 3 epochs
uninterrupted, then 3 rounds with a checkpoint and a resumed run to 6; writes (main process) whether the two final
LoRAs are bit-identical to argv[3] as JSON."""

import json
import os
import sys

import torch
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOConfig, DanceGRPOTrainer

model_dir, output_dir, result_path = sys.argv[1:4]
torch.set_num_threads(1)
# 8 prompts, 4 per round: 2 rounds per epoch. Each process: 4 samples x 5 steps = one micro-batch per round.
dataset = Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(8)]})


def run(folder, max_steps, resume=None):
    args = DanceGRPOConfig(
        output_dir=os.path.join(output_dir, folder),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="steps",
        save_steps=3,
        disable_tqdm=True,
        num_generations=2,
        generation_batch_size=8,
        num_inference_steps=6,
        height=32,
        width=32,
        max_sequence_length=16,
        per_device_train_batch_size=20,
        gradient_accumulation_steps=1,
        timestep_fraction=1.0,
        eta=1.0,
        max_steps=max_steps,
        learning_rate=1e-2,
        seed=3,
    )
    lora = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    trainer = DanceGRPOTrainer(model_dir, "brightness", args=args, train_dataset=dataset, peft_config=lora)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


full = run("full", 6)
run("interrupted", 3)
resumed = run("interrupted", 6, resume=os.path.join(output_dir, "interrupted", "checkpoint-3"))
pairs = zip(full.model.named_parameters(), resumed.model.parameters())
different = [name for (name, a), b in pairs if a.requires_grad and not torch.equal(a, b)]
if resumed.accelerator.is_main_process:
    with open(result_path, "w") as handle:
        json.dump(
            {"num_processes": resumed.accelerator.num_processes, "epoch": full.state.epoch, "different": different},
            handle,
        )
