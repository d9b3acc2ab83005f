"""Shared fixtures."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch.distributed as dist

# DeepSpeed (a test extra, the reference in the DeepSpeed parity tests) must not look for an
# accelerator or compile ops on this CPU machine; spawned ranks inherit the setting.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from hypothesis import settings

from tests.dist import harness

# [Note: a skip in CI is a failure] in tests/skip_rule.py
pytest_plugins = ["tests.skip_rule"]

# Hypothesis's default 200 ms deadline per example is a timed assertion: on shared or slow
# cores (or the CUDA builds of newer torch) it fails tests whose property holds.
settings.register_profile("shardwrap", deadline=None)
settings.load_profile("shardwrap")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "fresh_ranks: run_ranks starts new rank processes (forked from the preloaded "
        "server) for this test instead of using the session's pool (see [Note: pooled "
        "ranks] in tests/dist/harness.py)",
    )
    config.addinivalue_line(
        "markers",
        "spawned_ranks: run_ranks spawns new interpreters for this test (a test of what "
        "happens at interpreter exit, which forked ranks skip)",
    )


@pytest.fixture(autouse=True)
def _fresh_ranks_when_marked(request):
    """``@pytest.mark.fresh_ranks``: every run_ranks call of the test starts new ranks;
    ``@pytest.mark.spawned_ranks``: new interpreters."""
    settings = {
        name: True
        for marker, name in (("fresh_ranks", "FRESH_RANKS"), ("spawned_ranks", "SPAWNED_RANKS"))
        if request.node.get_closest_marker(marker) is not None
    }
    previous = {name: getattr(harness, name) for name in settings}
    for name, value in settings.items():
        setattr(harness, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(harness, name, value)


@pytest.fixture(autouse=True, scope="session")
def _rank_pools():
    """Pooled ranks live for the session; they end with it (atexit covers an interrupt)."""
    yield
    harness.shutdown_pools()


def pytest_terminal_summary(terminalreporter):
    replaced = [e for e in harness.POOL_EVENTS if "started" not in e]
    if harness.POOL_EVENTS:
        started = len(harness.POOL_EVENTS) - len(replaced)
        terminalreporter.write_line(f"rank pools: {started} started, {len(replaced)} replaced")
        for event in replaced:
            terminalreporter.write_line(f"  {event}")


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process, for single-process tests."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'rdv')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()
