"""The ledger's timing and labelling, and profile's summaries, without a process group."""

from __future__ import annotations

import pytest
import torch

from shardwrap import profile
from shardwrap.comm.collectives import CommLedger, CommRecord, Communicator


class _SlowWork:
    """A waitable standing in for ``dist.Work``; counts its waits."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


def test_group_of_one_records_and_times_nothing() -> None:
    ledger = CommLedger(time_collectives=True)
    ledger.record(CommRecord("all_gather", "params", 8, 2))
    comm = Communicator(None, ledger)
    out = torch.zeros(3)
    comm.all_gather(out, torch.ones(3), purpose="params", unit="u").wait()
    assert torch.equal(out, torch.ones(3))
    assert ledger.records == [CommRecord("all_gather", "params", 8, 2)]


def test_timed_work_notes_elapsed_on_wait() -> None:
    ledger = CommLedger(time_collectives=True)
    comm = Communicator(None, ledger)
    work = _SlowWork()
    start = comm._record("all_reduce", "grads", torch.zeros(4), unit="u")
    waitable = comm._timed(work, start)
    assert ledger.records[0].elapsed_s is None
    waitable.wait()
    assert work.waits == 1
    record = ledger.records[0]
    assert (record.unit, record.num_bytes) == ("u", 16)
    assert record.elapsed_s is not None and record.elapsed_s >= 0.0


def test_note_elapsed_after_reset_is_ignored() -> None:
    ledger = CommLedger()
    record = CommRecord("all_gather", "params", 8, 2)
    ledger.record(record)
    ledger.reset()
    ledger.note_elapsed(record, 1.0)
    assert ledger.records == []


def test_summarize_groups_by_unit_kind_purpose() -> None:
    records = [
        CommRecord("all_gather", "params", 8, 2, "a", 0.5),
        CommRecord("all_gather", "params", 8, 2, "a", 0.25),
        CommRecord("reduce_scatter", "grads", 32, 2, "a", None),
        CommRecord("all_reduce", "grad_presence", 4, 2, "", 0.125),
    ]
    stats = profile.summarize(records)
    assert stats == [
        profile.CollectiveStats("a", "all_gather", "params", 2, 16, 0.75, wire_bytes=8.0),
        profile.CollectiveStats("a", "reduce_scatter", "grads", 1, 32, 0.0, wire_bytes=16.0),
        # an all-reduce is two ring passes: twice (N-1)/N of its buffer
        profile.CollectiveStats(
            profile.SHARED_LABEL, "all_reduce", "grad_presence", 1, 4, 0.125, wire_bytes=4.0
        ),
    ]
    step = profile.StepProfile(wall_s=1.0, collectives=stats)
    assert step.bytes("all_gather") == 16
    assert step.by_kind()["all_reduce"] == (1, 4, 0.125)
    assert "grad_presence" in step.table()


def _numbered(index: int) -> CommRecord:
    return CommRecord("all_reduce", "grads", index, 2)


def test_ledger_drops_its_oldest_records_past_its_bound() -> None:
    ledger = CommLedger(max_records=10)
    for index in range(25):
        ledger.record(_numbered(index))
    kept = [r.num_bytes for r in ledger.records]
    assert len(kept) <= 10
    assert kept == list(range(25 - len(kept), 25))  # the newest, oldest first
    assert ledger.num_recorded == 25


def test_recorded_since_survives_drops_and_resets() -> None:
    ledger = CommLedger(max_records=10)
    for index in range(8):
        ledger.record(_numbered(index))
    mark = ledger.num_recorded
    for index in range(8, 12):  # crosses the bound: the oldest records go
        ledger.record(_numbered(index))
    assert [r.num_bytes for r in ledger.recorded_since(mark)] == [8, 9, 10, 11]
    mark = ledger.num_recorded
    ledger.record(_numbered(12))
    ledger.reset()
    ledger.record(_numbered(13))
    assert [r.num_bytes for r in ledger.recorded_since(mark)] == [13]  # all that remain
    assert ledger.recorded_since(ledger.num_recorded) == []


def test_ledger_bound_is_validated() -> None:
    with pytest.raises(ValueError, match="max_records"):
        CommLedger(max_records=1)
    with pytest.raises(TypeError, match="max_records"):
        CommLedger(max_records=2.5)  # type: ignore[arg-type]


def test_summaries_show_the_bytes_quantization_saved() -> None:
    records = [
        CommRecord("all_gather", "params", 254, 2, "a", unquantized_bytes=1000),
        CommRecord("all_gather", "params", 254, 2, "a", unquantized_bytes=1000),
        CommRecord("all_gather", "params", 1000, 2, "a"),  # a plain (backward) gather
        CommRecord("all_to_all", "grads", 129, 2, "b", unquantized_bytes=1000),
    ]
    step = profile.StepProfile(collectives=profile.summarize(records))
    assert step.saved_bytes(unit="a") == 2 * (1000 - 254)
    assert step.saved_bytes() == 2 * (1000 - 254) + 1000 - 129
    assert step.bytes("all_gather", "params", unit="a") == 2 * 254 + 1000
    assert "saved" in step.table()


def test_an_adopted_ledger_records_into_its_adopter_with_timing() -> None:
    """[Note: adopted ledgers]: a nested root's communicators keep their ledger; once an
    enclosing root adopts it, every record (and its wall time, when the adopter times)
    lands in the adopter's ledger, after the records the nested one had made."""
    outer, middle, inner = CommLedger(), CommLedger(), CommLedger()
    inner.record(CommRecord("broadcast", "init", 4, 2))
    middle.adopt(inner)
    outer.adopt(middle)
    assert outer.records == [CommRecord("broadcast", "init", 4, 2)] and not inner.records
    outer.time_collectives = True
    comm = Communicator(None, inner)
    comm.size = 2  # as if in a group of two, so it records (the work is a stand-in)
    work = _SlowWork()
    waitable = comm._timed(work, comm._record("all_reduce", "grads", torch.zeros(4), unit="u"))
    waitable.wait()
    assert [r.kind for r in outer.records] == ["broadcast", "all_reduce"]
    assert outer.records[-1].elapsed_s is not None and outer.num_recorded == 2
    assert not inner.records and not middle.records
    with pytest.raises(ValueError, match="adopt"):
        outer.adopt(inner)
