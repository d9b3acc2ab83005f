"""Seconds from a fault to the first resumed step, and steps lost, under torchrun.

Runs the three fault cases of tests/dist/test_elastic_restart.py (two torchrun agents on
this machine as two nodes, the fault in step 6 of examples/train_gpt.py's 8-step tiny run)
``--repeats`` times each, with the test's own launch code, and prints each case's
figures: the fault's time is what the fault worker wrote, the resumed step's end what rank
0 recorded. It checks nothing; the test does.

    PYTHONPATH=$PWD python benchmarks/bench_elastic.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.dist import test_elastic_restart as elastic  # noqa: E402

CASES = {  # name: (the fault, the tier resumed from), as tests/dist/test_elastic_restart.py
    "worker": ("kill", "memory"),
    "agent": ("kill-agent", "memory"),
    "hang": ("hang", "disk"),
}


def run_case(name: str, folder: Path) -> tuple[float, int]:
    fault, tier = CASES[name]
    options = elastic.memory_options(folder) if tier == "memory" else elastic.HANG_OPTIONS
    elastic._elastic(folder, name, options, fault)
    return elastic._figures(folder, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: expected >= 1, got {args.repeats}")
    rows = []
    for name in args.cases:
        figures = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                figures.append(run_case(name, Path(tmp)))
        seconds = [s for s, _ in figures]
        lost = sorted({n for _, n in figures})
        rows.append((name, CASES[name][1], seconds, lost))
    print(f"\n{'fault':8s} {'from':7s} {'median s':>9s} {'min s':>7s} {'max s':>7s}  steps lost")
    for name, tier, seconds, lost in rows:
        print(
            f"{name:8s} {tier:7s} {statistics.median(seconds):9.1f} {min(seconds):7.1f} "
            f"{max(seconds):7.1f}  {','.join(map(str, lost))}"
        )
    print(f"(load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())})")


if __name__ == "__main__":
    main()
