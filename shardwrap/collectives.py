"""The only module that calls ``torch.distributed`` collectives.

Every collective shardwrap issues goes through a :class:`Communicator`, which records
its kind and payload bytes in a :class:`CommLedger`. Tests count traffic there, and a
group of one rank never touches the network: its collectives are local copies and are
not recorded, because nothing is moved.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective as this rank issued it."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast"
    purpose: str  # e.g. "params", "grads", "grad_presence", "init"
    num_bytes: int  # bytes this rank sent into the collective (its input)
    group_size: int
    unit: str = ""  # the unit that issued it, when labelled (see Communicator.for_unit)
    elapsed_s: float | None = None  # issue to end of wait, when the ledger times collectives


@dataclass
class CommLedger:
    """Append-only list of collectives; ``reset`` between measured steps."""

    records: list[CommRecord] = field(default_factory=list)
    time_collectives: bool = False  # labelled communicators note wall times (shardwrap.profile)

    def record(self, record: CommRecord) -> None:
        self.records.append(record)

    def note_elapsed(self, record: CommRecord, seconds: float) -> None:
        """Attach a wall time to ``record`` (a no-op if the ledger was reset meanwhile)."""
        for index in range(len(self.records) - 1, -1, -1):
            if self.records[index] is record:
                self.records[index] = replace(record, elapsed_s=seconds)
                return

    def reset(self) -> None:
        self.records.clear()

    def count(self, kind: str, purpose: str | None = None) -> int:
        return sum(1 for r in self._matching(kind, purpose))

    def bytes(self, kind: str, purpose: str | None = None) -> int:
        return sum(r.num_bytes for r in self._matching(kind, purpose))

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(kind, purpose): (count, bytes)}``."""
        counts: Counter[tuple[str, str]] = Counter()
        sizes: Counter[tuple[str, str]] = Counter()
        for r in self.records:
            counts[(r.kind, r.purpose)] += 1
            sizes[(r.kind, r.purpose)] += r.num_bytes
        return {key: (counts[key], sizes[key]) for key in counts}

    def _matching(self, kind: str, purpose: str | None):
        return (
            r for r in self.records if r.kind == kind and (purpose is None or r.purpose == purpose)
        )


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _DoneWork:
    """Stand-in for a finished ``dist.Work`` (for groups of one rank)."""

    def wait(self) -> bool:
        return True


class Communicator:
    """Collectives over one process group, recorded in ``ledger``.

    ``group=None`` means a group of just this process (no network at all).
    """

    def __init__(self, group: dist.ProcessGroup | None, ledger: CommLedger) -> None:
        self.group = group
        self.ledger = ledger
        self.rank: int = dist.get_rank(group) if group is not None else 0
        self.size: int = dist.get_world_size(group) if group is not None else 1

    def all_gather(self, out_full: torch.Tensor, in_shard: torch.Tensor, *, purpose: str):
        """Concatenate every rank's ``in_shard`` into ``out_full``; returns a waitable."""
        if self.size == 1:
            out_full.copy_(in_shard)
            return _DoneWork()
        self._record("all_gather", purpose, in_shard)
        return dist.all_gather_single(out_full, in_shard, group=self.group, async_op=True)

    def reduce_scatter(self, out_shard: torch.Tensor, in_full: torch.Tensor, *, purpose: str):
        """Sum ``in_full`` over ranks and keep this rank's slice in ``out_shard``."""
        if self.size == 1:
            out_shard.copy_(in_full)
            return _DoneWork()
        self._record("reduce_scatter", purpose, in_full)
        return dist.reduce_scatter_single(
            out_shard, in_full, op=dist.ReduceOp.SUM, group=self.group, async_op=True
        )

    def all_reduce(self, tensor: torch.Tensor, *, purpose: str, op=dist.ReduceOp.SUM):
        """In-place reduction of ``tensor`` over ranks; returns a waitable."""
        if self.size == 1:
            return _DoneWork()
        self._record("all_reduce", purpose, tensor)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)

    def broadcast(self, tensor: torch.Tensor, *, src_rank: int, purpose: str):
        """Copy ``tensor`` from group rank ``src_rank`` to every rank; returns a waitable."""
        if self.size == 1:
            return _DoneWork()
        self._record("broadcast", purpose, tensor)
        return dist.broadcast(tensor, group=self.group, group_src=src_rank, async_op=True)

    def all_gather_object(self, obj: object, *, purpose: str) -> list[object]:
        """Every rank's ``obj`` (small Python values: flags, names, shapes)."""
        if self.size == 1:
            return [obj]
        gathered: list[object] = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.group)
        self.ledger.record(CommRecord("all_gather_object", purpose, 0, self.size))
        return gathered

    def _record(self, kind: str, purpose: str, tensor: torch.Tensor) -> None:
        self.ledger.record(CommRecord(kind, purpose, _num_bytes(tensor), self.size))

    def for_unit(self, unit: str) -> LabelledCommunicator:
        """The same group and ledger, with records labelled as ``unit``'s traffic."""
        labelled = LabelledCommunicator.__new__(LabelledCommunicator)
        labelled.__dict__.update(self.__dict__)  # same group, ledger, rank and size
        labelled.unit = unit
        return labelled


class LabelledCommunicator(Communicator):
    """A :class:`Communicator` whose records name their unit and, while the ledger's
    ``time_collectives`` is on, the wall time from issue to the end of their wait.

    Made by :meth:`Communicator.for_unit`; the collectives themselves are the base class's.
    """

    unit: str

    def all_gather(self, out_full: torch.Tensor, in_shard: torch.Tensor, *, purpose: str):
        return self._timed(super().all_gather, out_full, in_shard, purpose=purpose)

    def reduce_scatter(self, out_shard: torch.Tensor, in_full: torch.Tensor, *, purpose: str):
        return self._timed(super().reduce_scatter, out_shard, in_full, purpose=purpose)

    def all_reduce(self, tensor: torch.Tensor, *, purpose: str, op=dist.ReduceOp.SUM):
        return self._timed(super().all_reduce, tensor, purpose=purpose, op=op)

    def broadcast(self, tensor: torch.Tensor, *, src_rank: int, purpose: str):
        return self._timed(super().broadcast, tensor, src_rank=src_rank, purpose=purpose)

    def _timed(self, issue, *args, **kwargs):
        num_records = len(self.ledger.records)
        start = time.perf_counter()
        work = issue(*args, **kwargs)
        # Groups of one rank record nothing (nothing moves), so there is nothing to time.
        if not self.ledger.time_collectives or len(self.ledger.records) == num_records:
            return work
        return _TimedWork(work, self.ledger, self.ledger.records[-1], start)

    def _record(self, kind: str, purpose: str, tensor: torch.Tensor) -> None:
        self.ledger.record(CommRecord(kind, purpose, _num_bytes(tensor), self.size, self.unit))


class _TimedWork:
    """A waitable that notes, in the ledger, the time from issue to the end of its wait."""

    def __init__(self, work, ledger: CommLedger, record: CommRecord, start: float) -> None:
        self._work = work
        self._ledger = ledger
        self._record = record
        self._start = start

    def wait(self) -> bool:
        done = self._work.wait()
        self._ledger.note_elapsed(self._record, time.perf_counter() - self._start)
        return done


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()


def new_subgroups(rank_lists: list[list[int]]) -> list[dist.ProcessGroup]:
    """Create one group per rank list (every rank must call this with the same lists)."""
    return [dist.new_group(ranks) for ranks in rank_lists]


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    """Global ranks of ``group``, in group-rank order."""
    return dist.get_process_group_ranks(group)


def default_group() -> dist.ProcessGroup:
    return dist.group.WORLD
