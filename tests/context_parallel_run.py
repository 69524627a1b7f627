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
    DiffusionOPDConfig,
    DiffusionOPDTrainer,
    DiffusionSFTConfig,
    DiffusionSFTTrainer,
    DirectRewardConfig,
    DirectRewardTrainer,
    DMDConfig,
    DMDTrainer,
    OnlineDiffusionDPOConfig,
    OnlineDiffusionDPOTrainer,
    SPOConfig,
    SPOTrainer,
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
    if method == "sft":  # the same samples, brighter, as videos to imitate
        data = tiny_preference_dataset(kind, 4).rename_column("chosen", "video").remove_columns("rejected")
        args = DiffusionSFTConfig(**base, resolution=32, per_device_train_batch_size=2, learning_rate=10.0)
        return DiffusionSFTTrainer(model_dir, args=args, train_dataset=data, peft_config=peft)
    online = {
        "num_generations": 2, "generation_batch_size": 2, "num_inference_steps": 4, "height": 32, "width": 32,
        "activation_checkpointing": kind.startswith("wan"),
    }  # fmt: skip
    prompts = Dataset.from_dict({"prompt": ["a cat", "a dog", "a red house", "blue sky"]})
    grpo = {"learning_rate": 100.0, "per_device_train_batch_size": 2, "timestep_fraction": 0.6, "eta": 1.0, "epsilon": 0.5}  # fmt: skip
    if method.startswith("grpo"):
        # "grpo-reference": the KL to the reference (the LoRA switched off) and GRPO-Guard's stored means.
        options = {"beta": 0.04, "ratio_normalization": True} if method == "grpo-reference" else {}
        if method == "grpo-async":  # round 1 sampled by round 0's weights: decoupled PPO's π_prox forward, split
            options = {
                "max_staleness": 1,
                "max_steps": 4,
                "gradient_accumulation_steps": 1,
                "ratio_normalization": True,
            }
        base_ = base | ({"max_steps": options.pop("max_steps")} if "max_steps" in options else {})
        args = DanceGRPOConfig(**base_, **online, **grpo, **options)
        trainer_class = DanceGRPOTrainer
    elif method == "dppo":  # Flow-DPPO's trust region on the stored rollout means
        args = DanceGRPOConfig(**base, **online, **grpo, trust_region="dppo")
        trainer_class = DanceGRPOTrainer
    elif method.startswith("nft"):
        # "nft-guided": training forwards with CFG 4 through a second policy (policy_with), and AWM's fast EMA copy.
        guided = (
            {"train_guidance_scale": 4.0, "learning_rate": 10.0, "ema_kl_beta": 0.1} if method == "nft-guided" else {}
        )
        args = DiffusionNFTConfig(
            **(base | {"learning_rate": 1.0} | guided), **online, per_device_train_batch_size=2, timestep_fraction=0.5
        )
        trainer_class = DiffusionNFTTrainer
    elif method == "direct-guided":  # Direct-Align with a training guidance: the training forwards' policy copy
        args = DirectRewardConfig(
            **(base | {"learning_rate": 1000.0}), **(online | {"num_generations": 1}), per_device_train_batch_size=2,
            train_guidance_scale=4.0,
        )  # fmt: skip
        trainer_class = DirectRewardTrainer
    elif method == "spo":
        args = SPOConfig(
            **(base | {"learning_rate": 1.0}), **(online | {"num_generations": 1}), pool_start_step=2,
            per_device_train_batch_size=4, score_scale=100.0, pair_threshold=0.0,
        )  # fmt: skip
        trainer_class = SPOTrainer
    elif method == "online-dpo":
        args = OnlineDiffusionDPOConfig(
            **(base | {"learning_rate": 1.0}), **(online | {"generation_batch_size": 4}), per_device_train_batch_size=1,
            beta=500.0,
        )  # fmt: skip
        trainer_class = OnlineDiffusionDPOTrainer
    elif method == "opd":  # one teacher: a random LoRA on the same base, switched in for the teacher's forwards
        teacher = _random_lora_teacher(model_dir, os.path.join(output_dir, "teacher"))
        args = DiffusionOPDConfig(
            **(base | {"learning_rate": 10.0}), **online, per_device_train_batch_size=2, timestep_fraction=0.6,
            eta=1.0, teacher_adapters=[f"a={teacher}"],
        )  # fmt: skip
        prompts = prompts.add_column("task", ["a"] * len(prompts))
        trainer_class = DiffusionOPDTrainer
    elif method == "dmd":  # the fake score: a second copy with its own AdamW, its gradients reduced over the ranks
        args = DMDConfig(
            **(base | {"learning_rate": 100.0}), **(online | {"num_inference_steps": 2}),
            per_device_train_batch_size=2, fake_score_learning_rate=1e-3, teacher_guidance_scale=4.0,
        )  # fmt: skip
        trainer_class = DMDTrainer
    else:
        raise ValueError(f"unknown case method {method!r}")
    return trainer_class(model_dir, "brightness", args=args, train_dataset=prompts, peft_config=peft)


def _random_lora_teacher(model_dir: str, folder: str) -> str:
    """A LoRA with nonzero random B on the pipeline's transformer, saved in the diffusers format (one folder per
    process: each writes its own, identical)."""
    from diffusers import DiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    folder = f"{folder}-rank{os.environ.get('RANK', '0')}"
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    pipeline.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"]))
    generator = torch.Generator().manual_seed(7)
    for name, parameter in pipeline.transformer.named_parameters():
        if "lora_B" in name:
            parameter.data = 0.1 * torch.randn(parameter.shape, generator=generator)
    type(pipeline).save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(pipeline.transformer))
    return folder


for case in cases:
    kind, method, lora, model_dir = case.split(":", 3)
    name = f"{kind}-{method}-{lora}"
    trainer = build(kind, method, lora, model_dir, os.path.join(result_dir, name))
    rounds = []
    if hasattr(trainer, "_plan_round"):  # the methods that roll out
        original = trainer._plan_round

        def recording(rollout, plan, advantages, original=original, rounds=rounds):
            rounds.append({"latents": rollout["latents"].clone(), "log_probs": rollout.get("log_probs"),
                           "advantages": None if advantages is None else advantages.clone()})  # fmt: skip
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
