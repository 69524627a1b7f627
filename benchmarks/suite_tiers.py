"""The test suite's fast tier, from a measured run: reads the ``--durations=0`` report of a whole-suite run and writes
``tests/heavy_tests.txt``, the tests (by node id) whose own time (setup + call + teardown) is at least ``--threshold``
seconds; ``tests/conftest.py`` marks them ``slow`` beside the learning tests, so that ``-m "not slow"`` is the fast
tier. Prints both tiers' summed test time (two workers share it).

    bash scripts/test.sh --durations=0 > suite.log        # the whole suite, timed (an idle 2-core machine)
    python benchmarks/suite_tiers.py suite.log --threshold 3
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(tests/.+?)\s*$")  # (parameter ids may hold spaces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="the output of a whole-suite run with --durations=0")
    parser.add_argument("--threshold", type=float, default=3.0, help="seconds from which a test is heavy")
    parser.add_argument("--output", default=str(ROOT / "tests" / "heavy_tests.txt"))
    args = parser.parse_args()

    seconds: dict[str, float] = collections.defaultdict(float)
    for line in Path(args.report).read_text().splitlines():
        if match := LINE.match(line):
            seconds[match.group(3)] += float(match.group(1))
    if not seconds:
        raise SystemExit(f"{args.report}: no --durations=0 lines")
    heavy = sorted(node for node, s in seconds.items() if s >= args.threshold)
    header = (
        f"# Tests of at least {args.threshold:g} s (setup + call + teardown) in a measured whole-suite run, marked slow "
        "by tests/conftest.py:\n# the fast tier (-m 'not slow') leaves them out. Written by benchmarks/suite_tiers.py.\n"
    )
    Path(args.output).write_text(header + "".join(f"{node}\n" for node in heavy))
    fast = sum(s for node, s in seconds.items() if s < args.threshold)
    print(f"{len(seconds)} tests timed, {sum(seconds.values()) / 60:.1f} min summed; {len(heavy)} heavy "
          f"({sum(seconds[n] for n in heavy) / 60:.1f} min); the rest {fast / 60:.1f} min summed")  # fmt: skip


if __name__ == "__main__":
    main()
