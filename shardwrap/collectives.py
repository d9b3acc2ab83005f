"""The only module that calls ``torch.distributed`` collectives.

Every collective shardwrap issues goes through a :class:`Communicator`, which records
its kind and payload bytes in a :class:`CommLedger`. Tests count traffic there, and a
group of one rank never touches the network: its collectives are local copies and are
not recorded, because nothing is moved.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective as this rank issued it."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast"
    purpose: str  # e.g. "params", "grads", "grad_presence", "init"
    num_bytes: int  # bytes of the full (unsharded) buffer the collective works on
    group_size: int

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends on a ring: (N-1)/N of the buffer, twice for an all-reduce."""
        factor = 2.0 if self.kind == "all_reduce" else 1.0
        return factor * self.num_bytes * (self.group_size - 1) / self.group_size


@dataclass
class CommLedger:
    """Append-only list of collectives; ``reset`` between measured steps."""

    records: list[CommRecord] = field(default_factory=list)

    def record(self, record: CommRecord) -> None:
        self.records.append(record)

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
        self._record("all_gather", purpose, out_full)
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
