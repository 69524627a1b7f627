"""Run by tests/test_context_parallel.py under `accelerate launch` (1 or 2 CPU processes): a few rounds of a tiny
trainer with `context_parallel_size` = argv[4] (all processes in one group), recording each round's rollout latents
and log-probabilities and the trained weights of this rank to argv[3]/rank<r>.pt. Ends with a barrier and os._exit(0):
a 2-D mesh with a size-1 dimension makes about a third of clean gloo exits abort after the results are written."""

import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig

from trl_dance import (
    DanceGRPOConfig,
    DanceGRPOTrainer,
    DiffusionDPOConfig,
    DiffusionDPOTrainer,
    DiffusionNFTConfig,
    DiffusionNFTTrainer,
)
from trl_dance.testing import tiny_preference_dataset

model_dir, kind, result_dir, size, method, lora = sys.argv[1:7]
torch.set_num_threads(1)
peft = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]) if lora == "lora" else None
video = {"num_frames": 5} if kind.startswith(("wan", "hunyuan")) else {}
# SGD, so that the weights compare the gradients: gradients of order 1e-9 sit at Adam's ε (1e-8), where its step turns
# float summation-order differences (1e-7 relative) into 5e-3 of the step. The learning rates move them ~1e-2.
if method == "dpo":  # pairs of the tiny model's own samples, brighter over darker
    args = DiffusionDPOConfig(
        output_dir=os.path.join(result_dir, "out"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        disable_tqdm=True, resolution=32, max_sequence_length=16, per_device_train_batch_size=2, max_steps=2,
        learning_rate=1e-2, logging_steps=1, seed=3, context_parallel_size=int(size), beta=100.0, **video,
        optim="sgd",
    )  # fmt: skip
    trainer = DiffusionDPOTrainer(
        model_dir, args=args, train_dataset=tiny_preference_dataset(kind, 4), peft_config=peft
    )
common = dict(
    output_dir=os.path.join(result_dir, "out"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
    disable_tqdm=True, num_generations=2, generation_batch_size=2, num_inference_steps=4, height=32, width=32,
    max_sequence_length=16, max_steps=2, learning_rate={"grpo": 100.0}.get(method, 1.0), optim="sgd", logging_steps=1, seed=3,
    context_parallel_size=int(size), activation_checkpointing=kind.startswith("wan"),
    **video,
)  # fmt: skip
if method == "grpo":
    args = DanceGRPOConfig(**common, per_device_train_batch_size=2, timestep_fraction=0.6, eta=1.0, epsilon=0.5)
    trainer_class = DanceGRPOTrainer
elif method == "nft":
    args = DiffusionNFTConfig(**common, per_device_train_batch_size=2, timestep_fraction=0.5)
    trainer_class = DiffusionNFTTrainer
if method != "dpo":
    dataset = Dataset.from_dict({"prompt": ["a cat", "a dog", "a red house", "blue sky"]})
    trainer = trainer_class(model_dir, "brightness", args=args, train_dataset=dataset, peft_config=peft)
rounds, original = [], getattr(trainer, "_plan_round", None)


def recording(rollout, plan, advantages):
    rounds.append({"latents": rollout["latents"].clone(), "log_probs": rollout.get("log_probs"),
                   "advantages": advantages.clone()})  # fmt: skip
    return original(rollout, plan, advantages)


trainer._plan_round = recording
# The tokens the output projection sees (diffusers gathers after it): half the sequence on each rank when split.
block = trainer.model.proj_out
lengths = []
block.register_forward_pre_hook(
    lambda module, args, kwargs: lengths.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
    with_kwargs=True,
)
before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
trainer.train()
after = {name: p.detach().clone() for name, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
rank = trainer.accelerator.process_index
torch.save(
    {"rounds": rounds, "before": before, "after": {name: after[name] for name in before},
     "world": trainer.accelerator.num_processes, "tokens": sorted(set(lengths))},
    os.path.join(result_dir, f"rank{rank}.pt"),
)  # fmt: skip
if dist.is_initialized():
    dist.barrier()
sys.stdout.flush()
os._exit(0)
