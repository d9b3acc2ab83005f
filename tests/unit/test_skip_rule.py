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


# A module that skips as it is collected, as a missing test dependency's import would.
MODULE_SKIP = 'import pytest\n\npytest.importorskip("shardwrap_no_such_module")\n'


def _inner_run(tmp_path, ci: str) -> str:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    env = {**os.environ, "CI": ci, "PYTHONPATH": ROOT}
    command = [sys.executable, "-m", "pytest", "-p", "tests.skip_rule", "-rA", "-q"]
    command += ["-p", "no:cacheprovider", "-p", "no:xdist", "--continue-on-collection-errors"]
    command.append(str(tmp_path))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    return done.stdout


def test_under_ci_only_the_named_environment_gates_skip(tmp_path) -> None:
    out = _inner_run(tmp_path, "true")
    assert "2 failed, 1 skipped, 1 error" in out, out
    assert "FAILED test_cases.py::test_skipped_by_hand" in out, out
    assert "FAILED test_cases.py::test_missing_import" in out, out
    assert "ERROR test_module_skip.py" in out, out


def test_outside_ci_skips_stay_skips(tmp_path) -> None:
    """The control: the same files, CI unset, skip all four."""
    assert "4 skipped" in _inner_run(tmp_path, ""), "the rule applied outside CI"


def test_a_reason_that_only_contains_an_allowed_one_is_not_allowed() -> None:
    assert not skip_rule.unexpected_skip("Skipped: needs os.fork")
    assert skip_rule.unexpected_skip("Skipped: needs os.fork and a package that is missing")


def test_ci_says_it_is_ci() -> None:
    """.ci/run exports CI=true, so the rule runs there whatever its caller set."""
    with open(os.path.join(ROOT, ".ci", "run")) as script:
        assert "\nexport CI=true\n" in script.read()


@pytest.mark.parametrize("reason", sorted(skip_rule.ALLOWED_SKIPS))
def test_every_allowed_reason_is_a_skip_of_the_suite(reason: str) -> None:
    """No stale entry: each allowed reason is written in some test module."""
    found = subprocess.run(
        ["grep", "-rlF", "--include=*.py", reason, os.path.join(ROOT, "tests")],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert [f for f in found if not f.endswith(("skip_rule.py", "test_skip_rule.py"))], reason
