"""A pytest plugin (``-p benchmarks.suite_cost.plugin``): CPU seconds of every test item.

An item's CPU is this process's, plus its reaped children's (``RUSAGE_CHILDREN``), plus what
its live children (pooled ranks, the forkserver and the ranks it forked) spent during the
item, read with psutil. A child reaped during the item moves into ``RUSAGE_CHILDREN`` whole,
so what it had spent before the item is taken off again. One JSON line per item goes to
``SUITE_COST_CPU``.
"""

from __future__ import annotations

import json
import os
import resource
import time

import psutil
import pytest

_OUT = os.environ.get("SUITE_COST_CPU", "suite_cost_cpu.jsonl")
_ME = psutil.Process()


def _tree_cpu(process: psutil.Process) -> float:
    """A live child's CPU: its own, its reaped children's, its live descendants'."""
    times = process.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for kid in process.children(recursive=False):
        try:
            total += _tree_cpu(kid)
        except psutil.Error:
            pass
    return total


def _snapshot() -> tuple[float, float, dict]:
    mine = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = {}
    for child in _ME.children(recursive=False):
        try:
            live[(child.pid, child.create_time())] = _tree_cpu(child)
        except psutil.Error:
            pass
    return mine.ru_utime + mine.ru_stime, reaped.ru_utime + reaped.ru_stime, live


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own0, reaped0, live0 = _snapshot()
    start = time.monotonic()
    yield
    own1, reaped1, live1 = _snapshot()
    cpu = (own1 - own0) + (reaped1 - reaped0)
    cpu += sum(t - live0.get(key, 0.0) for key, t in live1.items())
    cpu -= sum(t for key, t in live0.items() if key not in live1)
    record = {"id": item.nodeid, "cpu": round(cpu, 3), "wall": round(time.monotonic() - start, 3)}
    with open(_OUT, "a") as out:
        out.write(json.dumps(record) + "\n")
