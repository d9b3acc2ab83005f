"""Runs the tests of one torch test file in this process; writes each test's outcome as JSON.

``python -m benchmarks.torch_suite.worker FILE --json OUT [--only ID ...]``. The folder of
FILE must be on ``sys.path`` (the driver puts it on PYTHONPATH) so that the ranks torch's
multi-process tests spawn import the test module by the same name. Whether shardwrap's
names are in place was settled at startup by ``boot/sitecustomize.py``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
import unittest
from pathlib import Path

# Worst first: a test keeps the worst outcome any of its subtests had.
RANK = {"error": 4, "fail": 3, "skip": 1, "pass": 0}


def _last_line(text: str) -> str:
    """The exception's own line (the traceback's last non-empty one), shortened."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:300]


class Recorder(unittest.TestResult):
    """Each test id -> {status, detail, traceback, seconds}."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, dict] = {}
        self._started: dict[str, float] = {}

    def _note(self, test, status: str, detail: str = "", tb: str = "") -> None:
        key = test.id()
        prev = self.outcomes.get(key)
        if prev is not None and RANK[prev["status"]] >= RANK[status]:
            return
        self.outcomes[key] = {"status": status, "detail": detail, "traceback": tb}

    def startTest(self, test) -> None:
        super().startTest(test)
        self._started[test.id()] = time.perf_counter()

    def stopTest(self, test) -> None:
        super().stopTest(test)
        entry = self.outcomes.setdefault(test.id(), {"status": "pass", "detail": ""})
        entry["seconds"] = round(time.perf_counter() - self._started[test.id()], 2)
        # Progress, for a long file: one line per test as it ends.
        print(
            f"[torch_suite] {test.id()}: {entry['status']} ({entry['seconds']} s)",
            file=sys.stderr,
            flush=True,
        )

    def _err(self, test, err, status: str) -> None:
        tb = self._exc_info_to_string(err, test)
        self._note(test, status, _last_line(tb), tb)

    def addError(self, test, err) -> None:
        super().addError(test, err)
        self._err(test, err, "error")

    def addFailure(self, test, err) -> None:
        super().addFailure(test, err)
        self._err(test, err, "fail")

    def addSkip(self, test, reason) -> None:
        super().addSkip(test, reason)
        self._note(test, "skip", str(reason)[:300])

    def addSubTest(self, test, subtest, err) -> None:
        super().addSubTest(test, subtest, err)
        if err is not None:
            is_fail = issubclass(err[0], test.failureException)
            self._err(test, err, "fail" if is_fail else "error")

    def addUnexpectedSuccess(self, test) -> None:
        super().addUnexpectedSuccess(test)
        self._note(test, "fail", "unexpected success of an expected failure")


def _tests_of(suite) -> list[unittest.TestCase]:
    if isinstance(suite, unittest.TestCase):
        return [suite]
    return [test for child in suite for test in _tests_of(child)]


def run_file(path: Path, only: list[str]) -> dict[str, dict]:
    """Import the test module by its file's name and run its tests (those in ``only``)."""
    sys.path.insert(0, str(path.parent))
    try:
        module = importlib.import_module(path.stem)
    except BaseException:  # noqa: BLE001 -- an import failure is the file's result
        return {
            f"{path.stem}.<import>": {
                "status": "error",
                "traceback": traceback.format_exc(),
                "detail": _last_line(traceback.format_exc()),
            }
        }
    tests = _tests_of(unittest.defaultTestLoader.loadTestsFromModule(module))
    if only:
        tests = [t for t in tests if t.id() in only or t.id().split(".", 1)[1] in only]
    result = Recorder()
    unittest.TestSuite(tests).run(result)
    return result.outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=[], help="test ids (Class.test) to run")
    args = parser.parse_args()
    outcomes = run_file(args.file.resolve(), args.only)
    args.json.write_text(json.dumps(outcomes, indent=1))


if __name__ == "__main__":
    main()
