"""A pytest plugin (tests/conftest.py loads it): under CI a skip is a failure, but for the
environment gates named here.

[Note: a skip in CI is a failure]
A skip hides a test that did not run: a broken install of a test dependency, or a check
that quietly stopped applying, would look like a pass. Only the environment gates named in
ALLOWED_SKIPS may skip, their reasons matched exactly (each a fact of the machine or of the
torch release under test, and each the reason of a skip in the suite); under CI
(``CI=true``, which .ci/run exports) any other skip, of a test or of a whole module as it
is collected, is reported as a failure naming its reason.
"""

from __future__ import annotations

import os

import pytest

ALLOWED_SKIPS = frozenset(
    {
        "page releases are Linux-only",
        "pins host memory where CUDA is available",
        "needs Linux /proc",
        "needs Linux /proc/self/clear_refs",
        "needs os.fork",
        "SHARDWRAP_SPAWN_POOLS=1: pooled ranks are spawned",
        "this torch's FSDP2 has no manual backward finalization",
    }
)
_PREFIX = "Skipped: "  # what pytest puts before a skip's reason


def unexpected_skip(reason: str) -> bool:
    """Whether a skip with ``reason`` (pytest's text for it) is none of ALLOWED_SKIPS."""
    return reason.removeprefix(_PREFIX) not in ALLOWED_SKIPS


def _fail_unexpected_skip(report) -> None:
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if unexpected_skip(reason):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which counts as a failure: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips as it is collected (a module-level ``importorskip``)."""
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())
