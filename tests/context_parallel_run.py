"""Run by tests/test_context_parallel.py under `accelerate launch` (1 or 2 CPU processes): for each case
"KIND:METHOD:LORA:MODEL_DIR" in argv[3:], a few optimizer updates of a tiny trainer with `context_parallel_size` =
argv[2] (all processes in one group), recording each round's rollout latents and log-probabilities, the trained
weights and the token count the output projection sees on this rank to argv[1]/<case>-rank<r>.pt. Several cases share
one launch (a launch costs more than a tiny case). Ends with a barrier and os._exit(0): a 2-D mesh with a size-1
dimension makes about a third of clean gloo exits abort after the results are written."""

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

result_dir, size, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
torch.set_num_threads(1)


def build(kind: str, method: str, lora: str, model_dir: str, output_dir: str):
    """The case's trainer. SGD, so that the weights compare the gradients: gradients of order 1e-9 sit at Adam's ε
    (1e-8), where its step turns float summation-order differences (1e-7 relative) into 5e-3 of the step. The
    learning rates move the weights by 1e-3 to 1."""
    peft = (
        LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]) if lora == "lora" else None
    )
    video = {"num_frames": 5} if kind.startswith(("wan", "hunyuan")) else {}
    base = dict(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True,
        max_sequence_length=16, max_steps=2, optim="sgd", logging_steps=1, seed=3, context_parallel_size=size,
        **video,
    )  # fmt: skip
    if method == "dpo":  # pairs of the tiny model's own samples, brighter over darker
        args = DiffusionDPOConfig(**base, resolution=32, per_device_train_batch_size=2, learning_rate=1e-2, beta=100.0)
        return DiffusionDPOTrainer(
            model_dir, args=args, train_dataset=tiny_preference_dataset(kind, 4), peft_config=peft
        )
    online = {
        "num_generations": 2, "generation_batch_size": 2, "num_inference_steps": 4, "height": 32, "width": 32,
        "activation_checkpointing": kind.startswith("wan"),
    }  # fmt: skip
    if method == "grpo":
        args = DanceGRPOConfig(
            **base, **online, learning_rate=100.0, per_device_train_batch_size=2, timestep_fraction=0.6, eta=1.0,
            epsilon=0.5,
        )  # fmt: skip
        trainer_class = DanceGRPOTrainer
    else:  # "nft", or "nft-guided": training forwards with CFG 4, through a second policy (policy_with)
        guided = {"train_guidance_scale": 4.0, "learning_rate": 10.0} if method == "nft-guided" else {}
        args = DiffusionNFTConfig(
            **(base | {"learning_rate": 1.0} | guided), **online, per_device_train_batch_size=2, timestep_fraction=0.5
        )
        trainer_class = DiffusionNFTTrainer
    prompts = Dataset.from_dict({"prompt": ["a cat", "a dog", "a red house", "blue sky"]})
    return trainer_class(model_dir, "brightness", args=args, train_dataset=prompts, peft_config=peft)


for case in cases:
    kind, method, lora, model_dir = case.split(":", 3)
    name = f"{kind}-{method}-{lora}"
    trainer = build(kind, method, lora, model_dir, os.path.join(result_dir, name))
    rounds = []
    if method != "dpo":
        original = trainer._plan_round

        def recording(rollout, plan, advantages, original=original, rounds=rounds):
            rounds.append({"latents": rollout["latents"].clone(), "log_probs": rollout.get("log_probs"),
                           "advantages": advantages.clone()})  # fmt: skip
            return original(rollout, plan, advantages)

        trainer._plan_round = recording
    # The tokens the output projection sees (diffusers gathers after it): half the sequence on each rank when split.
    lengths = []
    trainer.model.proj_out.register_forward_pre_hook(
        lambda module, args, lengths=lengths: lengths.append(args[0].shape[1])
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = {  # FSDP2 holds each parameter as a shard of a DTensor
        n: p.full_tensor() if hasattr(p, "full_tensor") else p
        for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
    }
    rank = trainer.accelerator.process_index
    if os.environ.get("TRL_DANCE_SAVE_MODEL"):  # (every process takes part: FSDP gathers the weights)
        trainer.save_model(os.path.join(result_dir, f"{name}-saved"))
    torch.save(
        {"rounds": rounds, "before": before, "after": {n: after[n].detach().clone() for n in before},
         "world": trainer.accelerator.num_processes, "tokens": sorted(set(lengths)), "sharded": "fsdp" if trainer.is_fsdp_enabled else "zero" if trainer.is_deepspeed_enabled else None,
         "tflops": sum(entry.get("perf/denoiser_tflops", 0.0) for entry in trainer.state.log_history)},
        os.path.join(result_dir, f"{name}-rank{rank}.pt"),
    )  # fmt: skip
if dist.is_initialized():
    dist.barrier()
sys.stdout.flush()
os._exit(0)
