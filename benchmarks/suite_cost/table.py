"""The per-module table of a measured run: ``python -m benchmarks.suite_cost.table CPU LOG``.

CPU is the plugin's JSON lines, LOG sitecustomize's process log; prints Markdown rows
(module, CPU seconds, interpreter starts, tests), costliest first. With two pairs of files
(before, then after) it prints both columns side by side.
"""

from __future__ import annotations

import collections
import json
import sys


def modules(cpu_file: str, log_file: str) -> dict[str, dict]:
    """Per test module: CPU seconds, interpreter starts (not the resource tracker), tests."""
    found: dict[str, dict] = collections.defaultdict(lambda: {"cpu": 0.0, "starts": 0, "tests": 0})
    with open(cpu_file) as lines:
        for line in lines:
            record = json.loads(line)
            row = found[record["id"].split("::")[0]]
            row["cpu"] += record["cpu"]
            row["tests"] += 1
    with open(log_file) as lines:
        for line in lines:
            fields = line.rstrip("\n").split("\t")
            if len(fields) == 4 and "resource_tracker" not in fields[3]:
                module = fields[2].split("::")[0]
                if module in found:
                    found[module]["starts"] += 1
    return dict(found)


def main(argv: list[str]) -> None:
    runs = [modules(argv[i], argv[i + 1]) for i in range(0, len(argv), 2)]
    names = sorted(set().union(*runs), key=lambda m: -max(r.get(m, {}).get("cpu", 0) for r in runs))
    empty = {"cpu": 0.0, "starts": 0, "tests": 0}
    heads = " | ".join("CPU s | starts | tests" for _ in runs)
    print(f"| module | {heads} |")
    print("|---|" + "---:|---:|---:|" * len(runs))
    for name in [*names, "total"]:
        cells = []
        for run in runs:
            if name == "total":
                row = {k: sum(r[k] for r in run.values()) for k in empty}
            else:
                row = run.get(name, empty)
            cells.append(f"{row['cpu']:.1f} | {row['starts']} | {row['tests']}")
        print(f"| {name.removeprefix('tests/')} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
