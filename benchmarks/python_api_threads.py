"""The README's Python example, timed per optimizer step under three OpenMP wait policies, with and without load.

    python benchmarks/python_api_threads.py              # on this machine as it is
    python benchmarks/python_api_threads.py --load 2     # beside 2 busy processes (a shared 2-core machine)

The example is the ``python`` block of README.md, run as written in a fresh interpreter of this environment:

- ``as installed``: no ``OMP_WAIT_POLICY`` given; what a user gets (``import trl_dance`` sets ``PASSIVE`` where torch is
  not loaded yet, and ``scripts/setup_env.sh``'s ``trl_dance_threads.pth`` sets it in every program of the venv);
- ``OpenMP default``: ``OMP_WAIT_POLICY`` present but empty, so libgomp keeps its own spinning default (what the
  example got before either fix: peft loads torch before trl_dance);
- ``PASSIVE``: set explicitly, as the ``trl-dance`` command sets it: the baseline of the ratios.

Prints the seconds per step of each (the Trainer's ``train_runtime`` / steps, model loading excluded) and its ratio
to the baseline measured in the same run, then a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"as installed": None, "OpenMP default": "", "PASSIVE": "PASSIVE"}


def readme_example() -> str:
    """The README's Python example, with a line printing the seconds per optimizer step."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    return code + (
        "\nimport json\n"
        "print('STEP_SECONDS', json.dumps(trainer.state.log_history[-1]['train_runtime'] / trainer.state.global_step))\n"
    )


def busy(processes: int) -> list[subprocess.Popen]:
    """``processes`` single-threaded processes multiplying matrices until killed (the other jobs of a shared machine)."""
    loop = "import torch; torch.set_num_threads(1); a = torch.randn(512, 512)\nwhile True: a = (a @ a).tanh()"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(processes)]


def run(code: str, policy: str | None, workdir: str) -> float:
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return float(result.stdout.split("STEP_SECONDS", 1)[1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", type=int, default=0, help="busy background processes while timing")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant (the fastest is kept)")
    args = parser.parse_args()
    code = readme_example()
    with tempfile.TemporaryDirectory() as workdir:
        model = Path(workdir) / "outputs" / "tiny-flux"
        subprocess.run(
            [sys.executable, "-m", "trl_dance.testing", "flux", str(model)], check=True, capture_output=True
        )
        load = busy(args.load)
        try:
            seconds = {name: min(run(code, policy, workdir) for _ in range(args.repeats))
                       for name, policy in VARIANTS.items()}  # fmt: skip
        finally:
            for process in load:
                process.kill()
    baseline = seconds["PASSIVE"]
    for name, value in seconds.items():
        print(f"{name:>15}: {value:.3f} s/step ({value / baseline:.2f}x PASSIVE)")
    print(json.dumps({"load": args.load, "cpus": os.cpu_count(), "s_per_step": seconds}))


if __name__ == "__main__":
    main()
