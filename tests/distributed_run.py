"""Run by tests/test_deepspeed.py and tests/test_fsdp.py under `accelerate launch --config_file
trl_dance/accelerate_configs/{zero2,zero3,fsdp2}.yaml`: a short GRPO, DiffusionNFT or Diffusion-DPO run on a tiny
pipeline, LoRA or full fine-tune, then `save_model`.

argv: trainer (grpo | nft | direct | dpo), mode (lora | full), model_dir, output_dir, result_path, and optionally a JSON object of
further config values. The main process writes what it saw (process count, distributed type, ZeRO stage, whether the
parameters were partitioned, the losses) to result_path as JSON.
"""

import json
import sys

import torch
from datasets import Dataset
from peft import LoraConfig

from trl_dance import (
    DanceGRPOConfig,
    DanceGRPOTrainer,
    DiffusionDPOConfig,
    DiffusionDPOTrainer,
    DiffusionNFTConfig,
    DiffusionNFTTrainer,
    DirectRewardConfig,
    DirectRewardTrainer,
)
from trl_dance.testing import tiny_preference_dataset

trainer_name, mode, model_dir, output_dir, result_path = sys.argv[1:6]
overrides = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
torch.set_num_threads(1)
common = {
    "output_dir": output_dir,
    "use_cpu": True,
    "bf16": False,
    "report_to": "none",
    "save_strategy": "no",
    "disable_tqdm": True,
    "max_steps": 2,
    "learning_rate": 1e-3,
    "logging_steps": 1,
    "seed": 3,
    "gradient_accumulation_steps": 2,
}
peft = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]) if mode == "lora" else None


def partition_everything(args):
    # ZeRO-3 keeps parameters under 1e5 elements whole on every rank: all of a tiny model's. Partition them all,
    # as a real model's are, so that saving has to gather them.
    if args.deepspeed_plugin is None:
        return args
    zero = args.deepspeed_plugin.deepspeed_config["zero_optimization"]
    if zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return args


if trainer_name == "grpo":
    grpo = {
        "num_generations": 2,
        "generation_batch_size": 4,
        "num_inference_steps": 4,
        "height": 32,
        "width": 32,
        "max_sequence_length": 16,
        "per_device_train_batch_size": 3,
        "timestep_fraction": 1.0,
        "eta": 1.0,
    }
    args = DanceGRPOConfig(**common, **(grpo | overrides))
    dataset = Dataset.from_dict({"prompt": ["a cat", "a dog", "a red house", "blue sky"]})
    trainer = DanceGRPOTrainer(
        model_dir, "brightness", args=partition_everything(args), train_dataset=dataset, peft_config=peft
    )
elif trainer_name == "nft":
    # 4 samples per process, 3 noise levels each, 3 per micro-batch: 4 micro-batches, 2 updates per round.
    nft = {"num_generations": 4, "generation_batch_size": 8, "num_inference_steps": 4, "height": 32, "width": 32}
    nft |= {"max_sequence_length": 16, "per_device_train_batch_size": 3, "timestep_fraction": 0.75}
    args = DiffusionNFTConfig(**common, **(nft | overrides))
    dataset = Dataset.from_dict({"prompt": ["a cat", "a dog", "a red house", "blue sky"]})
    trainer = DiffusionNFTTrainer(
        model_dir, "brightness", args=partition_everything(args), train_dataset=dataset, peft_config=peft
    )
elif trainer_name == "direct":
    # 4 images per process, denoise + inversion items, 4 per micro-batch: 2 micro-batches, one update per round.
    direct = {"num_generations": 1, "generation_batch_size": 8, "num_inference_steps": 4, "height": 32, "width": 32}
    direct |= {"max_sequence_length": 16, "per_device_train_batch_size": 4, "srp": False}
    args = DirectRewardConfig(**common, **(direct | overrides))
    dataset = Dataset.from_dict({"prompt": ["a cat", "a dog", "a red house", "blue sky"] * 2})
    trainer = DirectRewardTrainer(
        model_dir, "brightness", args=partition_everything(args), train_dataset=dataset, peft_config=peft
    )
else:
    args = DiffusionDPOConfig(**common, resolution=32, max_sequence_length=16, per_device_train_batch_size=2, beta=500)
    trainer = DiffusionDPOTrainer(
        model_dir, args=partition_everything(args), train_dataset=tiny_preference_dataset("sd", 16), peft_config=peft
    )
trainer.train()
trainer.save_model(output_dir)  # every process calls it: under ZeRO-3 gathering the weights is collective
if trainer.accelerator.is_main_process:
    with open(result_path, "w") as handle:
        json.dump(
            {
                "num_processes": trainer.accelerator.num_processes,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "zero_stage": trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage,
                "partitioned": any(
                    getattr(p, "ds_numel", 0) > p.numel() or type(p).__name__ == "DTensor"
                    for p in trainer.model.parameters()
                ),
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            },
            handle,
        )
trainer.accelerator.wait_for_everyone()  # no process exits while another still talks to it
trainer.accelerator.end_training()
