"""Spread of the learning tests' gains across noise streams (seeds) and reduction orders (torch thread counts).

A learning test on a tiny model is a chaotic computation: another CPU's kernels, another thread count or another
seed change the trajectory from the first update on. Its margin must hold across all of them, so this script runs
the learning tests (pytest marker ``slow``) once per (seed, threads) pair and prints, per test and metric, every
gain, the smallest, the margin the test asserts and the smallest gain's ratio to that margin.

    python benchmarks/learning_spread.py --seeds 42 1 2 --threads 1 2        # every learning test (~25 min)
    python benchmarks/learning_spread.py --seeds 42 1 2 -k ddpo              # one test

The last line printed is JSON: ``{"tests": {test/metric: {"gains": {"seed/threads": gain}, "min_gain", "margin",
"min_over_margin"}}, "failed_runs": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(seed: int, threads: int, select: str | None, workers: int) -> tuple[list[dict], int]:
    """One pytest run of the learning tests; returns the verdicts they logged and pytest's exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "learning.jsonl"
        env = os.environ | {
            "TRL_DANCE_TEST_SEED": str(seed),
            "TRL_DANCE_TEST_THREADS": str(threads),
            "TRL_DANCE_LEARNING_LOG": str(log),
            "PYTHONPATH": str(ROOT),  # this checkout's trl_dance, whichever one the environment installed
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        command = [sys.executable, "-m", "pytest", "-q", "-m", "slow", "-p", "no:cacheprovider", "-n", str(workers)]
        command += ["-k", select] if select else []
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL).returncode
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return records, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("-k", dest="select", help="pytest -k expression to pick tests")
    parser.add_argument("--workers", type=int, help="pytest-xdist workers (default: 2 cores / threads)")
    args = parser.parse_args()

    table: dict[str, dict] = {}
    failed = []
    for threads in args.threads:
        for seed in args.seeds:
            records, code = run(seed, threads, args.select, args.workers or max(1, 2 // threads))
            if code != 0:
                failed.append(f"{seed}/{threads}")
            for record in records:
                entry = table.setdefault(f"{record['test']} {record['metric']}", {"gains": {}, "noise": {}})
                entry["gains"][f"{seed}/{threads}"] = record["gain"]
                entry["noise"][f"{seed}/{threads}"] = record["noise"]
                entry["margin"] = record["margin"]
            print(f"seed {seed}, {threads} thread(s): {len(records)} verdicts, pytest exit {code}", flush=True)
            for record in records:
                print(
                    f"  {record['test']} {record['metric']}: {record['first']:.4f} -> {record['last']:.4f}", flush=True
                )

    print(f"\n{'test / metric':<92} {'min gain':>9} {'margin':>8} {'min/margin':>10}  gains (seed/threads)")
    for name, entry in sorted(table.items()):
        gains = entry["gains"]
        entry["min_gain"] = min(gains.values())
        entry["min_over_margin"] = entry["min_gain"] / entry["margin"] if entry["margin"] else None
        ratio = f"{entry['min_over_margin']:.2f}" if entry["min_over_margin"] is not None else "-"
        listed = " ".join(f"{key}:{gain:+.4f}" for key, gain in gains.items())
        print(f"{name:<92} {entry['min_gain']:>+9.4f} {entry['margin']:>8.4f} {ratio:>10}  {listed}")
    print(json.dumps({"tests": table, "failed_runs": failed}))


if __name__ == "__main__":
    main()
