"""Reward gain of the forward-process losses against the number of optimizer updates per round (issue #41's setting).

Tiny FLUX, full fine-tuning, Adam lr 1e-3, one group of 4 samples per round, 6 deterministic steps, 5 noise levels per
sample (20 items: micro-batches of 4), 24 rounds, a colour reward no test uses (greenness). Prints, per configuration,
the gain of the mean reward (first 3 → last 3 rounds) in units of the first round's reward std, and writes the table as
JSON. Usage: ``python benchmarks/nft_updates.py [--seeds 0 1] [--out benchmarks/results/nft_updates.json]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from datasets import Dataset

from trl_dance import DiffusionNFTConfig, DiffusionNFTTrainer
from trl_dance.testing import save_tiny_pipeline

PROMPTS = ["a cat", "a dog", "a red house", "blue sky", "green tree", "old car", "big ship", "sun set"]
CONFIGS = [  # (name, loss_type, extra config)
    ("nft, old policy per round", "nft", {"old_policy_update": "round"}),
    ("nft (default: per update)", "nft", {}),
    ("nft β 0.1, per round", "nft", {"old_policy_update": "round", "nft_beta": 0.1}),
    ("awm", "awm", {}),
    ("dgpo", "dgpo", {}),
]


def greenness(prompts, images, **kwargs):
    return (images[:, 1] - images[:, [0, 2]].mean(dim=1)).mean(dim=(1, 2)).tolist()


def run(model: str, loss_type: str, extra: dict, updates: int, seed: int) -> float:
    items_per_round, micro = 20, 4
    values = {
        "output_dir": tempfile.mkdtemp(),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 1,
        "num_generations": 4,
        "generation_batch_size": 4,
        "num_inference_steps": 6,
        "height": 32,
        "width": 32,
        "max_sequence_length": 16,
        "learning_rate": 1e-3,
        "weight_decay": 0.0,
        "per_device_train_batch_size": micro,
        "timestep_fraction": 5 / 6,
        "timestep_selection": "random" if loss_type != "dgpo" else "first",
        "gradient_accumulation_steps": items_per_round // micro // updates,
        "max_steps": 24 * updates,
        "guidance_scale": 3.5,
        "loss_type": loss_type,
        "seed": seed,
        "max_idle_rounds": 0,
    }
    trainer = DiffusionNFTTrainer(
        model,
        greenness,
        args=DiffusionNFTConfig(**(values | extra)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [h["reward"] for h in logs]
    return (sum(rewards[-3:]) - sum(rewards[:3])) / 3 / logs[0]["reward_std"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--updates", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = save_tiny_pipeline("flux", tempfile.mkdtemp() + "/flux")
    table = []
    for name, loss_type, extra in CONFIGS:
        row = {"configuration": name}
        for updates in args.updates:
            gains = [run(model, loss_type, extra, updates, seed) for seed in args.seeds]
            row[f"{updates} updates/round"] = gains
            print(f"{name}, {updates} updates per round: gains {[round(g, 2) for g in gains]}", flush=True)
        table.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"seeds": args.seeds, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
