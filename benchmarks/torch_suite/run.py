"""torch's own FSDP test files, run under torch's FSDP and again with shardwrap's names.

``python -m benchmarks.torch_suite.run --tests DIR [FILE ...]``: each test file named (all
``test_*.py`` in DIR when none is) runs in a fresh process twice, first as torch ships it
(the control) and then with ``shardwrap.install()`` (and the private spellings of
``swap.py``) in place in every process, before the test module is imported. Prints one row
per test with both outcomes, and the counts. The test files are torch's and stay outside
this repository; see README.md for how to get them.
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODES = ("torch", "shardwrap")


def _env(tests_dir: Path, mode: str) -> dict[str, str]:
    env = dict(os.environ)
    # boot/ first so its sitecustomize runs at every process's start; the tests' folder so
    # spawned ranks import the test module by name; the repo so this copy of shardwrap and
    # benchmarks.torch_suite import.
    paths = [str(HERE / "boot"), str(tests_dir), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")  # keeps the reason the last line
    env["SW_TORCH_SUITE_INSTALL"] = "1" if mode == "shardwrap" else "0"
    return env


def run_one(
    path: Path, mode: str, timeout: float, only: list[str], log_dir: Path
) -> dict[str, dict]:
    """One file in one mode, in a fresh process (its output in ``log_dir``); a timeout is
    the file's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "outcomes.json"
        cmd = [sys.executable, "-m", "benchmarks.torch_suite.worker", str(path), "--json"]
        cmd += [str(out), *(["--only", *only] if only else [])]
        log = log_dir / f"{path.stem}.{mode}.log"
        start = time.perf_counter()
        try:
            with log.open("w") as sink:
                env = _env(path.parent, mode)
                proc = subprocess.run(
                    cmd, env=env, cwd=REPO, timeout=timeout, stdout=sink, stderr=subprocess.STDOUT
                )
        except subprocess.TimeoutExpired:
            detail = f"over {timeout:.0f} s (see {log})"
            return {f"{path.stem}.<file>": {"status": "timeout", "detail": detail}}
        if not out.exists():
            tail = log.read_text().strip().splitlines()[-1:] or [""]
            detail = f"rc={proc.returncode}: {tail[0][:300]}"
            return {f"{path.stem}.<file>": {"status": "error", "detail": detail}}
        outcomes = json.loads(out.read_text())
        for entry in outcomes.values():
            entry.setdefault("seconds", round(time.perf_counter() - start, 1))
        return outcomes


def table(results: dict[str, dict[str, dict]]) -> str:
    """Markdown: one row per test id, torch's outcome, shardwrap's, shardwrap's reason."""
    ids = sorted(set(results["torch"]) | set(results["shardwrap"]))
    rows = ["| test | torch | shardwrap | shardwrap's failure |", "|---|---|---|---|"]
    for test_id in ids:
        ours = results["shardwrap"].get(test_id, {})
        theirs = results["torch"].get(test_id, {})
        why = ours.get("detail", "") if ours.get("status") in ("fail", "error") else ""
        why = why.replace("|", "\\|")
        rows.append(
            f"| {test_id} | {theirs.get('status', '-')} | {ours.get('status', '-')} | {why} |"
        )
    return "\n".join(rows)


def counts(results: dict[str, dict[str, dict]]) -> str:
    """The line the README quotes: control passes, and how many of those pass here."""
    torch_pass = {k for k, v in results["torch"].items() if v["status"] == "pass"}
    both = {k for k in torch_pass if results["shardwrap"].get(k, {}).get("status") == "pass"}
    skipped = sum(v["status"] == "skip" for v in results["torch"].values())
    other = len(results["torch"]) - len(torch_pass) - skipped
    return (
        f"{len(results['torch'])} tests: {len(torch_pass)} pass under torch's FSDP "
        f"({skipped} skipped, {other} fail or error); {len(both)} of those "
        f"{len(torch_pass)} pass with shardwrap installed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=Path, required=True, help="folder of torch's files")
    parser.add_argument("files", nargs="*", help="test files in that folder (default: all)")
    parser.add_argument("--only", nargs="*", default=[], help="test ids (Class.test_name)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per file")
    parser.add_argument("--json", type=Path, help="write every outcome here too")
    parser.add_argument(
        "--cpu-ranks",
        action="store_true",
        help="let multi-process tests start ranks without accelerators (cpu_ranks.py)",
    )
    parser.add_argument(
        "--lift-gpu-gates",
        action="store_true",
        help="run tests gated on accelerators on a machine without any (gates.py)",
    )
    parser.add_argument(
        "--fsdp1-cpu-device-id",
        action="store_true",
        help="torch's FSDP1 built without device_id takes device_id='cpu' (gates.py)",
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--logs",
        type=Path,
        default=Path(tempfile.gettempdir()) / "torch_suite",
        help="each run's output, FILE.MODE.log (progress: one line a test)",
    )
    args = parser.parse_args()
    if args.cpu_ranks:
        os.environ["SW_TORCH_SUITE_CPU_RANKS"] = "1"
    if args.lift_gpu_gates:
        os.environ["SW_TORCH_SUITE_LIFT_GATES"] = "1"
    if args.fsdp1_cpu_device_id:
        os.environ["SW_TORCH_SUITE_FSDP1_CPU"] = "1"
    args.logs.mkdir(parents=True, exist_ok=True)
    names = args.files or sorted(p.name for p in args.tests.glob("test_*.py"))
    results: dict[str, dict[str, dict]] = {mode: {} for mode in MODES}
    for name in names:
        for mode in args.modes:
            path = (args.tests / name).resolve()
            outcomes = run_one(path, mode, args.timeout, args.only, args.logs)
            results[mode].update(outcomes)
            n_pass = sum(v["status"] == "pass" for v in outcomes.values())
            print(f"{name} [{mode}]: {n_pass}/{len(outcomes)} pass", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results))
    print()
    print(counts(results))


if __name__ == "__main__":
    main()
