"""Python objects over a Communicator's group: flags, names, shapes, small records.

Kept apart from :mod:`.collectives` (whose :class:`~.collectives.Communicator` offers these
methods) for size: one concept, the pickled values, and how little a rank receives.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from ..base.gc_pause import gc_paused
from .ledger import CommRecord


class ObjectCollectives:
    """The object collectives of :class:`~shardwrap.comm.collectives.Communicator` (a
    mixin: it reads the communicator's group, rank, size and ledger)."""

    def all_gather_object(self, obj: object, *, purpose: str) -> list[object]:
        """Every rank's ``obj`` (small Python values: flags, names, shapes)."""
        if self.size == 1:
            return [obj]
        self.check_can_communicate()
        gathered: list[object] = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.group)
        self.ledger.record(CommRecord("all_gather_object", purpose, 0, self.size))
        return gathered

    def gather_object(self, obj: object, *, purpose: str, dst_rank: int = 0) -> list | None:
        """Every rank's ``obj`` on group rank ``dst_rank`` (by rank); ``None`` on the others.

        Unlike torch's ``gather_object`` (which all-gathers every rank's size first), what a
        rank other than ``dst_rank`` receives does not grow with the group: an all-reduce
        of the largest size (8 bytes), then a gather of the pickled objects padded to it.
        Recorded as that all-reduce and a ``gather_object`` of this rank's pickled bytes.
        (JSON values travel without pickle: :mod:`.json_values`.)
        """
        if self.size == 1:
            return [obj]
        payload = pickle.dumps(obj)
        largest = torch.tensor([len(payload)], dtype=torch.int64)
        self.all_reduce(largest, purpose=purpose, op=dist.ReduceOp.MAX).wait()
        framed = torch.zeros(8 + int(largest), dtype=torch.uint8)
        framed[:8] = torch.frombuffer(
            bytearray(len(payload).to_bytes(8, "little")), dtype=torch.uint8
        )
        framed[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        staged = self._stage(framed)
        gathered = (
            [torch.empty_like(staged) for _ in range(self.size)] if self.rank == dst_rank else None
        )
        dist.gather(staged, gathered, group=self.group, group_dst=dst_rank)
        self.ledger.record(CommRecord("gather_object", purpose, len(payload), self.size))
        if gathered is None:
            return None
        with gc_paused():  # many small objects: see base/gc_pause.py
            return [_unframe(t.cpu()) for t in gathered]

    def broadcast_object(self, obj: object, *, purpose: str, src_rank: int = 0) -> object:
        """Group rank ``src_rank``'s ``obj`` on every rank: its size (an 8-byte all-reduce),
        then its pickled bytes; what a rank receives does not grow with the group."""
        if self.size == 1:
            return obj
        payload = pickle.dumps(obj) if self.rank == src_rank else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self.all_reduce(size, purpose=purpose).wait()
        data = torch.zeros(int(size), dtype=torch.uint8)
        if payload:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(data, src_rank=src_rank, purpose=purpose).wait()
        return pickle.loads(data.numpy().tobytes())  # noqa: S301 - from our own ranks


def _unframe(framed: torch.Tensor) -> object:
    """The object a rank framed for :meth:`Communicator.gather_object`."""
    raw = framed.numpy().tobytes()
    length = int.from_bytes(raw[:8], "little")
    return pickle.loads(raw[8 : 8 + length])  # noqa: S301 - from our own ranks
