"""A pytest plugin (tests/conftest.py loads it): under CI a skip is a failure, but for the
environment gates named here.

[Note: a skip in CI is a failure]
A skip hides a test that did not run: a broken install of a test dependency, or a check
that quietly stopped applying, would look like a pass. Only the environment gates named in
ALLOWED_SKIPS may skip (each a fact of the machine or of the torch release under test, and
each the reason of one skipif in the suite); under CI (``CI=true``, as .ci/run runs) any
other skip is reported as a failure naming its reason.
"""

from __future__ import annotations

import os

import pytest

ALLOWED_SKIPS = (
    "page releases are Linux-only",
    "pins host memory where CUDA is available",
    "needs Linux /proc",
    "needs os.fork",
    "SHARDWRAP_SPAWN_POOLS=1: pooled ranks are spawned",
    "this torch's FSDP2 has no manual backward finalization",
)


def unexpected_skip(reason: str) -> bool:
    """Whether a skip with ``reason`` (pytest's text for it) is none of ALLOWED_SKIPS."""
    return not any(allowed in reason for allowed in ALLOWED_SKIPS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if unexpected_skip(reason):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which counts as a failure: {reason}"
