"""Exit handling without a process group: what ``release_all`` does to tracked holders.

See [Note: process groups at interpreter exit] in ``shardwrap/base/at_exit.py``; the
multi-rank check is ``tests/dist/test_exit.py``.
"""

from __future__ import annotations

import gc

import pytest

from shardwrap.base import at_exit


class _Holder:
    def __init__(self) -> None:
        self.num_released = 0

    def release_group(self) -> None:
        self.num_released += 1


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    calls: list[float] = []
    monkeypatch.setattr(at_exit.time, "sleep", calls.append)
    monkeypatch.setattr(at_exit, "_live", type(at_exit._live)())
    monkeypatch.setattr(at_exit, "_registered", True)  # no real exit handler in pytest
    return calls


def test_live_holders_are_released_then_the_gil_is_let_go(sleeps: list[float]) -> None:
    holders = [_Holder(), _Holder()]
    for holder in holders:
        at_exit.track(holder)
    at_exit.release_all()
    assert [h.num_released for h in holders] == [1, 1]
    assert sleeps == [at_exit.EXIT_GRACE_S]


def test_nothing_alive_means_no_pause(sleeps: list[float]) -> None:
    at_exit.track(_Holder())  # dropped at once: a model that was collected
    gc.collect()
    at_exit.release_all()
    assert sleeps == []
