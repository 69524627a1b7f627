"""Asynchronous rounds (`max_staleness`) on the tiny FLUX: wall-clock with a slow reward, and learning over seeds.

GRPO with a LoRA (the setting of ``tests/test_dance_grpo.py::test_brightness_rises``: 32 samples per round in groups of
4, 6 steps, one update per round, lr 3e-2), rewarded by brightness.

* ``--wall``: the reward sleeps ``--reward-seconds`` per call (a judge that reasons: ~1 s). Prints, per
  ``max_staleness``, the training time, the time per round, its ratio to ``max_staleness=0`` measured in the same run,
  and the reward time the trainer still waited for (``async/reward_exposed_s``).
* ``--learning``: no sleep; the reward gain (mean of the last 3 rounds minus the first 3) over ``--seeds`` for each
  configuration: s = 0, s = 1 (decoupled PPO), s = 1 without the correction ("bypass"), s = 2.

One JSON line per run on stdout (and appended to ``--out``), then a table. Usage::

    python benchmarks/async_rounds.py --wall --rounds 8
    python benchmarks/async_rounds.py --learning --seeds 42 1 2 3 7 --rounds 30
    python benchmarks/async_rounds.py --learning --seeds 42 1 2 3 7 --rounds 40 --learning-rate 1e-2 --configurations s=0 s=1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOConfig, DanceGRPOTrainer
from trl_dance.testing import save_tiny_pipeline

PROMPTS = ["a cat", "a dog", "a red house", "blue sky", "green tree", "old car", "big ship", "sun set"]
LEARNING = {  # name: config overrides
    "s=0": {"max_staleness": 0},
    "s=1": {"max_staleness": 1},
    "s=1 bypass": {"max_staleness": 1, "importance_sampling_correction": False},
    "s=2": {"max_staleness": 2},
}


def slow_brightness(seconds: float):
    def brightness(prompts, images, **kwargs):
        time.sleep(seconds)
        return images.mean(dim=tuple(range(1, images.ndim))).tolist()

    return brightness


def run(model: str, rounds: int, seed: int, reward_seconds: float, learning_rate: float = 3e-2, **overrides) -> dict:
    values = {
        "output_dir": tempfile.mkdtemp(),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 1,
        "num_generations": 4,
        "generation_batch_size": 32,
        "num_inference_steps": 6,
        "height": 32,
        "width": 32,
        "max_sequence_length": 16,
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 10,
        "timestep_fraction": 1.0,
        "eta": 1.0,
        "learning_rate": learning_rate,
        "max_steps": rounds,
        "seed": seed,
    }
    lora = LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_out", "proj_mlp"])
    trainer = DanceGRPOTrainer(
        model,
        slow_brightness(reward_seconds),
        args=DanceGRPOConfig(**(values | overrides)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=lora,
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [h["reward"] for h in logs]
    exposed = [h.get("async/reward_exposed_s", 0.0) for h in logs]
    return {
        "seed": seed,
        "rounds": rounds,
        "reward_seconds": reward_seconds,
        "learning_rate": learning_rate,
        **overrides,
        "train_s": seconds,
        "round_s": seconds / rounds,
        "reward_exposed_s_per_round": sum(exposed) / len(exposed),
        "first": sum(rewards[:3]) / 3,
        "last": sum(rewards[-3:]) / 3,
        "gain": (sum(rewards[-3:]) - sum(rewards[:3])) / 3,
        "first_reward_std": logs[0]["reward_std"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wall", action="store_true")
    parser.add_argument("--learning", action="store_true")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--reward-seconds", type=float, default=1.0)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--learning-rate", type=float, default=3e-2)
    parser.add_argument("--configurations", nargs="+", default=list(LEARNING), choices=list(LEARNING))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = save_tiny_pipeline("flux", tempfile.mkdtemp())
    records = []

    def emit(record: dict) -> None:
        records.append(record)
        print(json.dumps(record), flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(record) + "\n")

    if args.wall:
        for s in args.staleness:
            record = run(model, args.rounds, args.seeds[0], args.reward_seconds, args.learning_rate, max_staleness=s)
            emit(record | {"kind": "wall"})
        base = next(r for r in records if r["max_staleness"] == 0)
        print(
            "\n| max_staleness | s per round | ratio to s = 0 | reward waited for per round (s) |\n|---|---|---|---|"
        )
        for r in records:
            print(
                f"| {r['max_staleness']} | {r['round_s']:.2f} | {r['round_s'] / base['round_s']:.2f} | "
                f"{r['reward_exposed_s_per_round']:.2f} |"
            )
    if args.learning:
        gains: dict[str, list[float]] = {}
        for name in args.configurations:
            for seed in args.seeds:
                record = run(model, args.rounds, seed, 0.0, args.learning_rate, **LEARNING[name]) | {
                    "kind": "learning",
                    "name": name,
                }
                emit(record)
                gains.setdefault(name, []).append(record["gain"])
        print("\n| configuration | mean gain | min | max | seeds |\n|---|---|---|---|---|")
        for name, values in gains.items():
            print(
                f"| {name} | {statistics.mean(values):.4f} | {min(values):.4f} | {max(values):.4f} | {len(values)} |"
            )


if __name__ == "__main__":
    main()
