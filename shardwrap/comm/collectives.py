"""The only module that calls ``torch.distributed`` collectives (with :mod:`.pairwise`, its
point-to-point half on gloo, and :mod:`.object_collectives`, its Python-object half).

Every collective shardwrap issues goes through a :class:`Communicator`, which records
its kind and payload bytes in a :class:`CommLedger`. Tests count traffic there, and a
group of one rank never touches the network: its collectives are local copies and are
not recorded, because nothing is moved.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..base import at_exit
from . import pairwise
from .checks import (
    CollectiveChecker,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankDisagreementError,
)
from .ledger import CommLedger, CommRecord
from .object_collectives import ObjectCollectives

__all__ = [
    "CollectiveChecker",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommLedger",
    "CommRecord",
    "Communicator",
    "RankDisagreementError",
]

ROOT_LABEL = "(root)"  # how records name the root module's unit (whose name is "")


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def is_offline_group(group: object) -> bool:
    """Whether ``group`` is an offline group ([Note: offline groups] in comm/groups.py):
    no ``ProcessGroup`` nor any other object of torch's distributed package (a gloo or
    NCCL backend object stays refused as a group), but answering ``rank()`` and ``size()``."""
    kind = type(group)
    return (
        group is not None
        and not isinstance(group, (dist.ProcessGroup, tuple))
        and not kind.__module__.startswith(("torch.distributed", "torch._C"))
        and callable(getattr(group, "rank", None))
        and callable(getattr(group, "size", None))
    )


class _DoneWork:
    """Stand-in for a finished ``dist.Work`` (for groups of one rank)."""

    def wait(self) -> bool:
        return True


class Communicator(ObjectCollectives):
    """Collectives over one process group, recorded in ``ledger``.

    ``group=None`` means a group of just this process (no network at all).
    """

    def __init__(self, group: dist.ProcessGroup | None, ledger: CommLedger) -> None:
        self.group = group
        self.ledger = ledger
        # The group's own rank and size: a group built without a default process group is
        # not in torch's registry, so ``dist.get_rank(group)`` cannot answer for it.
        self.rank: int = group.rank() if group is not None else 0
        self.size: int = group.size() if group is not None else 1
        # [Note: offline groups] in comm/groups.py: ranks and sizes, no collective.
        self.offline = is_offline_group(group)
        self.checker: CollectiveChecker | None = None  # debug: verify ranks agree first
        # [Note: host tensors on accelerator-only backends]
        # Flags, norms and counts are small host tensors. A group whose backend has no CPU
        # transport (plain "nccl") cannot reduce them, so they travel through a copy on the
        # current accelerator; "gloo" or a device-mapped backend ("cpu:gloo,cuda:nccl",
        # torch's default) reduces them where they are.
        backend = None if group is None or self.offline else group_backend(group)
        self.host_capable = backend is None or backend_handles_cpu(backend)
        self.staging_device: torch.device | None = None  # None: the current accelerator
        self._gloo = backend == "gloo"
        self.gathers_placed = True  # False: chunk gathers land in rank order (benchmarks)
        self._released = False
        if group is not None and not self.offline:
            at_exit.track(self)

    def release_group(self) -> None:
        """Drop the reference to the process group; see [Note: process groups at interpreter
        exit]. Any later collective raises."""
        self.group = None
        self._released = True

    def check_can_communicate(self) -> None:
        """Raise unless collectives can run here: not an offline group, not released."""
        if self.offline:
            raise RuntimeError(
                f"process_group: a {type(self.group).__name__} (rank and size only) cannot "
                "communicate; it serves wrapping and sharding, not training: pass a "
                "torch.distributed ProcessGroup (see [Note: offline groups] in comm/groups.py)"
            )
        if self._released:
            raise RuntimeError(
                "shardwrap: this module's process group was released at interpreter exit; "
                "no collective can run after that (see shardwrap/base/at_exit.py)"
            )

    def all_gather(
        self, out_full: torch.Tensor, in_shard: torch.Tensor, *, purpose: str, unit="", **note
    ):
        """Concatenate every rank's ``in_shard`` into ``out_full``; returns a waitable.

        ``note``: further :class:`CommRecord` fields (``unquantized_bytes``)."""
        if self.size == 1:
            out_full.copy_(in_shard)
            return _DoneWork()
        start = self._record("all_gather", purpose, out_full, unit, **note)
        if self._pairwise(out_full):
            work = pairwise.all_gather(self.group, self.rank, self.size, out_full, in_shard)
            return self._timed(work, start)
        work = dist.all_gather_single(out_full, in_shard, group=self.group, async_op=True)
        return self._timed(work, start)

    def places_pieces(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`all_gather_placed` can fill ``tensor`` (pairwise exchanges only)."""
        return self.gathers_placed and self.size > 1 and self._pairwise(tensor)

    def all_gather_placed(self, out, in_shard, places, *, gathered_numel: int, purpose, unit=""):
        """Every rank's ``in_shard`` pieces into ``out`` at ``places`` (see
        ``pairwise.all_gather_placed``; only where :meth:`places_pieces`), recorded as an
        all-gather of ``gathered_numel`` elements that sends only this rank's pieces."""
        own = sum(end - start for start, end, _ in places[self.rank])
        sent = (self.size - 1) * own * in_shard.element_size()
        start = self._record("all_gather", purpose, out[:gathered_numel], unit, sent_bytes=sent)
        work = pairwise.all_gather_placed(self.group, self.rank, self.size, out, in_shard, places)
        return self._timed(work, start)

    def reduce_scatter(self, out_shard, in_full, *, purpose: str, unit="", peer_slices=None):
        """Sum ``in_full`` over ranks and keep this rank's slice in ``out_shard``.

        ``in_full`` must stay unchanged until the wait. ``peer_slices``: what is known of the
        slices (``pairwise.PeerSlices``: a peer layout's paddings, each rank's real
        elements), acted on where the collective is pairwise (gloo)."""
        if self.size == 1:
            out_shard.copy_(in_full)
            return _DoneWork()
        if self._pairwise(in_full):
            peer = peer_slices or pairwise.PeerSlices()
            sent = peer.sent_bytes(self.rank, self.size, in_full)
            start = self._record("reduce_scatter", purpose, in_full, unit, sent_bytes=sent)
            args = (self.group, self.rank, self.size, out_shard, in_full, peer)
            return self._timed(pairwise.reduce_scatter(*args), start)
        start = self._record("reduce_scatter", purpose, in_full, unit)
        work = dist.reduce_scatter_single(
            out_shard, in_full, op=dist.ReduceOp.SUM, group=self.group, async_op=True
        )
        return self._timed(work, start)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *, purpose: str, unit: str, **note):
        """Slice r of ``inp`` (1D, ``size`` equal slices) to rank r; rank r's slice for this
        rank into slice r of ``out``. Returns a waitable; ``note`` as for all_gather."""
        if self.size == 1:
            out.copy_(inp)
            return _DoneWork()
        start = self._record("all_to_all", purpose, inp, unit, **note)
        if self._pairwise(inp):
            work = pairwise.all_to_all(self.group, self.rank, self.size, out, inp)
            return self._timed(work, start)
        work = dist.all_to_all_single(out, inp, group=self.group, async_op=True)
        return self._timed(work, start)

    def all_reduce(
        self, tensor: torch.Tensor, *, purpose: str, unit: str = "", op=dist.ReduceOp.SUM
    ):
        """In-place reduction of ``tensor`` over ranks; returns a waitable."""
        if self.size == 1:
            return _DoneWork()
        start = self._record("all_reduce", purpose, tensor, unit)
        staged = self._stage(tensor)
        work = dist.all_reduce(staged, op=op, group=self.group, async_op=True)
        return self._copied_back(self._timed(work, start), staged, tensor)

    def broadcast(self, tensor: torch.Tensor, *, src_rank: int, purpose: str):
        """Copy ``tensor`` from group rank ``src_rank`` to every rank; returns a waitable."""
        if self.size == 1:
            return _DoneWork()
        start = self._record("broadcast", purpose, tensor)
        staged = self._stage(tensor)
        work = dist.broadcast(staged, group=self.group, group_src=src_rank, async_op=True)
        return self._copied_back(self._timed(work, start), staged, tensor)

    def gather(self, tensor: torch.Tensor, *, purpose: str, dst_rank: int = 0) -> list | None:
        """Every rank's ``tensor`` (the same shape and dtype on every rank) on group rank
        ``dst_rank``, by rank, as host tensors; ``None`` on the others."""
        if self.size == 1:
            return [tensor.detach().clone()]
        self._record("gather", purpose, tensor)
        staged = self._stage(tensor)
        gathered = (
            [torch.empty_like(staged) for _ in range(self.size)] if self.rank == dst_rank else None
        )
        dist.gather(staged, gathered, group=self.group, group_dst=dst_rank)
        return None if gathered is None else [t.cpu() for t in gathered]

    def run_user(self, kind: str, purpose: str, tensor: torch.Tensor, unit: str, call):
        """Check (debug) and record ``kind`` over ``tensor``, then ``call()``, a user's object
        ([Note: user communicators] in user_comms.py); its work (None: done) as a waitable."""
        start = self._record(kind, purpose, tensor, unit)
        work = call()
        return self._timed(_DoneWork() if work is None else work, start)

    def _pairwise(self, tensor: torch.Tensor) -> bool:
        """Whether to run an all-gather or reduce-scatter as pairwise exchanges.

        See [Note: pairwise collectives on gloo].
        """
        return self._gloo and tensor.device.type == "cpu"

    def _stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, or a copy on the accelerator when this group cannot reduce host memory."""
        if self.host_capable or tensor.device.type != "cpu":
            return tensor
        device = self.staging_device or _current_accelerator()
        return tensor.to(device, copy=True)

    @staticmethod
    def _copied_back(work, staged: torch.Tensor, tensor: torch.Tensor):
        return work if staged is tensor else _CopyBackWork(work, staged, tensor)

    def _record(self, kind: str, purpose: str, tensor: torch.Tensor, unit="", **note) -> float:
        """Check (debug), record, and return the issue time for :meth:`_timed`."""
        self.check_can_communicate()
        if self.checker is not None:
            self.checker.check(kind, purpose, unit, tensor, self.size)
        self.ledger.record(CommRecord(kind, purpose, _num_bytes(tensor), self.size, unit, **note))
        return time.perf_counter()

    def _timed(self, work, start: float):
        if not self.ledger.timing:
            return work
        return _TimedWork(work, self.ledger, self.ledger.last(), start)


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


class _CopyBackWork:
    """A waitable whose wait also copies a staged result back into the caller's tensor."""

    def __init__(self, work, staged: torch.Tensor, tensor: torch.Tensor) -> None:
        self._work = work
        self._staged = staged
        self._tensor = tensor

    def wait(self) -> bool:
        done = self._work.wait()
        self._tensor.copy_(self._staged)
        return done


def backend_handles_cpu(backend: str) -> bool:
    """Whether a backend (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``) moves host tensors."""
    name = str(backend).lower()
    if ":" in name:
        return "cpu:" in name
    return name not in ("nccl", "xccl", "hccl")


def _current_accelerator() -> torch.device:
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise RuntimeError("collectives: the process group has no CPU backend and no accelerator")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_backend(group: dist.ProcessGroup) -> str:
    """The backend name of ``group``, registered with torch or not (``"gloo"``, ``"nccl"``)."""
    try:
        return dist.get_backend(group)
    except (ValueError, RuntimeError):
        return group.name()


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
