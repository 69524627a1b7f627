"""Run by tests/test_multiprocess.py under `accelerate launch` with two processes: GRPO (argv[4] "grpo"),
DiffusionNFT ("nft") or DMD ("dmd": RTDMD's stage 2 with DMD2's GAN head and the teacher from another checkpoint,
argv[5]; the fake score, the head and their optimizer are compared too, and across the two processes) for 6 rounds over 3 epochs, or Diffusion-DPO ("dpo") for 6 steps over 3 epochs, uninterrupted, then 3 rounds / steps with a
checkpoint and a resumed run to 6; writes (main process) whether the two final LoRAs are bit-identical to argv[3] as
JSON."""

import json
import os
import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from PIL import Image

from trl_dance import (
    DanceGRPOConfig,
    DanceGRPOTrainer,
    DiffusionDPOConfig,
    DiffusionDPOTrainer,
    DiffusionNFTConfig,
    DiffusionNFTTrainer,
    DMDConfig,
    DMDTrainer,
)
from trl_dance.testing import tiny_preference_dataset

model_dir, output_dir, result_path, kind = sys.argv[1:5]
teacher = sys.argv[5] if kind == "dmd" else None
torch.set_num_threads(1)
# 8 prompts, 4 per round: 2 rounds per epoch. Each process: 4 samples x 5 steps = one micro-batch per round.
dataset = Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(8)]})
pairs = tiny_preference_dataset("sd", 16) if kind == "dpo" else None


def run(folder, max_steps, resume=None):
    """Train ``kind`` for ``max_steps`` in ``output_dir/folder``, checkpointing every 3 steps; LoRA r 4."""
    common = {
        "output_dir": os.path.join(output_dir, folder),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "save_strategy": "steps",
        "save_steps": 3,
        "disable_tqdm": True,
        "max_sequence_length": 16,
        "max_steps": max_steps,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",  # the same schedule whatever max_steps the interrupted run had
        "seed": 3,
    }
    lora = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    if kind == "dpo":
        # 16 pairs, 4 per step on each of the 2 processes: 2 steps per epoch; random crops, flips, caption dropout.
        args = DiffusionDPOConfig(
            **common,
            resolution=16,
            random_crop=True,
            proportion_empty_prompts=0.3,
            per_device_train_batch_size=4,
            beta=1000.0,
        )
        trainer = DiffusionDPOTrainer(model_dir, args=args, train_dataset=pairs, peft_config=lora)
        trainer.train(resume_from_checkpoint=resume)
        return trainer
    if kind == "nft":
        # Each process: 4 samples x 3 noise levels = one micro-batch per round; the old policy decays from step 0.
        args = DiffusionNFTConfig(
            **common,
            num_generations=2,
            generation_batch_size=8,
            num_inference_steps=4,
            timestep_fraction=0.75,
            height=32,
            width=32,
            per_device_train_batch_size=12,
            gradient_accumulation_steps=1,
            old_policy_decay="delayed",
        )
        trainer = DiffusionNFTTrainer(model_dir, "brightness", args=args, train_dataset=dataset, peft_config=lora)
        trainer.train(resume_from_checkpoint=resume)
        return trainer
    if kind == "dmd":
        # Each process: 4 samples of 2 steps; a micro-batch of last steps and one of PPO steps per round, one update;
        # 2 fake-score updates per round.
        args = DMDConfig(
            **common,
            num_generations=2,
            generation_batch_size=8,
            num_inference_steps=2,
            height=32,
            width=32,
            per_device_train_batch_size=4,
            guidance_scale=3.5,
            teacher_guidance_scale=4.5,
            gan_generator_weight=0.1,  # with DMD2's GAN head (built at the first fake update) on real images
            loss_type="rtdmd",  # RTDMD's stage 2: PPO on group advantages, DMD and AC-DMD's fake score at the last step
            policy_gradient_steps=1,
            teacher_model_name_or_path=teacher,
        )
        images = Dataset.from_dict(
            {"prompt": dataset["prompt"], "image": [Image.new("RGB", (40, 48), (16 * i, 250, 90)) for i in range(8)]}
        )
        trainer = DMDTrainer(model_dir, "brightness", args=args, train_dataset=images, peft_config=lora)
        trainer.train(resume_from_checkpoint=resume)
        return trainer
    args = DanceGRPOConfig(
        **common,
        num_generations=2,
        generation_batch_size=8,
        num_inference_steps=6,
        height=32,
        width=32,
        per_device_train_batch_size=20,
        gradient_accumulation_steps=1,
        timestep_fraction=1.0,
        eta=1.0,
    )
    trainer = DanceGRPOTrainer(model_dir, "brightness", args=args, train_dataset=dataset, peft_config=lora)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


full = run("full", 6)
run("interrupted", 3)
resumed = run("interrupted", 6, resume=os.path.join(output_dir, "interrupted", "checkpoint-3"))
both = zip(full.model.named_parameters(), resumed.model.parameters())
different = [name for (name, a), b in both if a.requires_grad and not torch.equal(a, b)]
if kind == "dmd":
    fake = resumed.fake_score.params
    different += [f"fake_score.{name}" for name, a in full.fake_score.params.items() if not torch.equal(a, fake[name])]
    head = dict(resumed.gan_head.named_parameters())
    different += [f"gan_head.{name}" for name, a in full.gan_head.named_parameters() if not torch.equal(a, head[name])]
    flat = torch.cat([value.flatten() for value in [*fake.values(), *head.values()]])
    ranks = resumed.accelerator.gather(flat[None])  # (2, n): the fake score and head the same on both processes
    different += ["fake_score across processes"] if not torch.equal(ranks[0], ranks[1]) else []
if resumed.accelerator.is_main_process:
    with open(result_path, "w") as handle:
        json.dump(
            {"num_processes": resumed.accelerator.num_processes, "epoch": full.state.epoch, "different": different},
            handle,
        )
resumed.accelerator.wait_for_everyone()  # no process exits while another still talks to it
resumed.accelerator.end_training()
