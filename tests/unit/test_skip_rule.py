"""[Note: a skip in CI is a failure] (tests/skip_rule.py), on an inner pytest run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import skip_rule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = """
import pytest

def test_skipped_by_hand():
    pytest.skip("no such package")

def test_missing_import():
    pytest.importorskip("shardwrap_no_such_module")

@pytest.mark.skipif(True, reason="needs os.fork")
def test_an_environment_gate():
    pass
"""


def _inner_run(tmp_path, ci: str) -> str:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "CI": ci, "PYTHONPATH": ROOT}
    command = [sys.executable, "-m", "pytest", "-p", "tests.skip_rule", "-rA", "-q"]
    command += ["-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path / "test_cases.py")]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    return done.stdout


def test_under_ci_only_the_named_environment_gates_skip(tmp_path) -> None:
    out = _inner_run(tmp_path, "true")
    assert "2 failed, 1 skipped" in out, out
    assert "FAILED test_cases.py::test_skipped_by_hand" in out, out
    assert "FAILED test_cases.py::test_missing_import" in out, out


def test_outside_ci_skips_stay_skips(tmp_path) -> None:
    """The control: the same file, CI unset, skips all three."""
    assert "3 skipped" in _inner_run(tmp_path, ""), "the rule applied outside CI"


@pytest.mark.parametrize("reason", skip_rule.ALLOWED_SKIPS)
def test_every_allowed_reason_is_a_skip_of_the_suite(reason: str) -> None:
    """No stale entry: each allowed reason is written in some test module."""
    found = subprocess.run(
        ["grep", "-rlF", reason, os.path.join(ROOT, "tests")], capture_output=True, text=True
    ).stdout.split()
    assert [f for f in found if not f.endswith(("skip_rule.py", "test_skip_rule.py"))], reason
