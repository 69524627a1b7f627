"""The real task's acceptance figures: a method trained on the text task, judged on the held-out words by both OCR
engines and by within-prompt diversity, over several seeds.

Per seed: the recipe (default ``recipes/configs/grpo_ocr_tiny.yaml``) runs with that seed, then the base model and
the trained LoRA are sampled by the pipeline's own sampler (``StableDiffusion3Pipeline.__call__``: the task's 10 steps,
CFG 4.5) on the 200 held-out words, ``--samples_per_word`` seeds each, and read by PP-OCR (the reward's engine) and
EasyOCR (never trained on). Diversity is the mean pairwise RMS pixel difference between a word's samples
(:func:`trl_dance.text_task.evaluation.within_prompt_diversity`); a collapsed policy scores 0.

    python benchmarks/text_task.py --seeds 0 1 2                      # DanceGRPO, the recipe as written
    python benchmarks/text_task.py --seeds 0 -- --max_steps 20 --learning_rate 3e-3

Prints one line per seed and a JSON summary last; wall times are the training run's, on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def evaluate(lora: str | None, samples_per_word: int, threads: int) -> dict[str, float]:
    command = [sys.executable, "-m", "trl_dance.text_task", "evaluate", "--samples_per_word", str(samples_per_word)]
    command += ["--lora", lora] if lora else []
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default="recipes/configs/grpo_ocr_tiny.yaml")
    parser.add_argument("--samples_per_word", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="after --: more recipe options, e.g. --max_steps 20")
    args = parser.parse_args()

    base = evaluate(None, args.samples_per_word, args.threads)
    print("base", json.dumps(base), flush=True)
    runs = {}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as output:
            command = [sys.executable, "recipes/train.py", "--config", args.config, "--seed", str(seed)]
            command += ["--output_dir", output, "--eval_strategy", "no", "--eval_on_start", "false", *args.extra]
            env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
            start = time.perf_counter()
            subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
            minutes = (time.perf_counter() - start) / 60
            scores = evaluate(output, args.samples_per_word, args.threads)
        gain = {key: scores[key] - base[key] for key in ("rapidocr/exact", "easyocr/exact")}
        runs[seed] = {"train_minutes": round(minutes, 1), **scores, "gain": gain,
                      "diversity_ratio": scores["diversity"] / base["diversity"]}  # fmt: skip
        print(f"seed {seed}: {minutes:.1f} min; rapidocr exact {base['rapidocr/exact']:.3f} -> "
              f"{scores['rapidocr/exact']:.3f}, easyocr exact {base['easyocr/exact']:.3f} -> "
              f"{scores['easyocr/exact']:.3f}, diversity {runs[seed]['diversity_ratio']:.2f}x base", flush=True)  # fmt: skip
    print(json.dumps({"config": args.config, "extra": args.extra, "base": base, "runs": runs}))


if __name__ == "__main__":
    main()
