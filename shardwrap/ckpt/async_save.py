"""Asynchronous checkpoint saves: stage on the caller's thread, write in the background.

[Note: asynchronous saves]
``save_checkpoint(..., asynchronous=True)`` does on the caller's (training) thread only
what must see the state as of the call: the opening agreement (collectives on the world
group, in order with the training's), a copy of every tensor the rank saves into host
buffers of its own (:meth:`AsyncSaver.stage`), the rank's run record (generators, data
position) and snapshots of the JSON that goes into the index. It then returns an
:class:`AsyncSave` and a background thread writes and hashes the rank's files, gathers
every rank's report and lets rank 0 commit the index, then learns the outcome.

The background collectives run on a gloo group of their own (``comm.groups.side_group``,
created by every rank at its first asynchronous save of the model), so they never run
concurrently with the training's on the same group, and in the same order on every rank:
one save runs at a time, since every save of a model (either kind) first waits for the
one in flight. A failure anywhere raises from every rank's ``result()``, naming the rank
(and the file, for a write that failed).

The staging buffers belong to the model's saver and are reused while the saved pieces
keep their keys, shapes and dtypes: after the first save a save allocates nothing (they
are pinned when the state lives on an accelerator, so the copies run at full speed).
Files are written under temporary names and the index last, so a process killed in the
background write leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import enum
import threading
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..base.pages import release_resident
from ..comm.collectives import Communicator
from ..comm.groups import side_group
from ..comm.ledger import CommLedger
from .format import CheckpointError
from .safetensors_writer import StreamItem


class SaveState(enum.Enum):
    """Where an asynchronous save stands."""

    RUNNING = enum.auto()  # the background thread writes, gathers or commits
    SUCCEEDED = enum.auto()  # the index is written; every rank learnt it
    FAILED = enum.auto()  # ``error`` says why; the previous checkpoint stands


class AsyncSave:
    """The handle of one asynchronous save (returned by ``save_checkpoint``)."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank  # world rank of this process
        self.state = SaveState.RUNNING
        self.error: BaseException | None = None  # set when FAILED
        self.observed = False  # whether wait() or result() has reported the outcome
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        """Whether the background work has ended (successfully or not)."""
        return self.state is not SaveState.RUNNING

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save ends; raise its error (every rank raises the same one)."""
        if self._thread is not None:
            self._thread.join(timeout)
        if not self.done():
            raise TimeoutError(f"asynchronous save of {self.path}: still running after {timeout} s")
        self.observed = True
        if self.error is None:
            return
        if isinstance(self.error, CheckpointError):
            raise self.error
        raise CheckpointError(
            f"asynchronous save of checkpoint {self.path} failed on rank {self.rank}: "
            f"{type(self.error).__name__}: {self.error}"
        ) from self.error

    def result(self, timeout: float | None = None) -> str:
        """The checkpoint's path, once committed; raises the save's error."""
        self.wait(timeout)
        return self.path

    def _run(self, job: Callable[[Communicator], None], comm: Communicator) -> None:
        try:
            job(comm)
        except BaseException as exc:  # noqa: BLE001 - handed to result() on this thread's behalf
            self.error = exc
            self.state = SaveState.FAILED
        else:
            self.state = SaveState.SUCCEEDED


class AsyncSaver:
    """One model's asynchronous saves: staging buffers, background group, save in flight."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm  # the background group's (its own ledger: not the training's)
        self.buffers: dict[str, torch.Tensor] = {}  # by piece key; 1-D, the piece's dtype
        self.in_flight: AsyncSave | None = None

    def stage(self, items: list[StreamItem]) -> list[StreamItem]:
        """``items`` copied into this saver's host buffers (reused when they fit)."""
        kept: dict[str, torch.Tensor] = {}
        staged: list[StreamItem] = []
        on_accelerator = False
        for item in items:
            source = item.produce().detach()
            buffer = self.buffers.get(item.key)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                pinned = source.device.type != "cpu"
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pinned)
            buffer.copy_(source, non_blocking=True)
            on_accelerator |= source.device.type != "cpu"
            release_resident(source)  # DiskOffload's mapped shard: read once, dropped
            kept[item.key] = buffer
            staged.append(StreamItem(item.key, item.dtype, item.shape, lambda b=buffer: b))
        if on_accelerator:
            torch.accelerator.synchronize()  # the copies must land before training goes on
        self.buffers = kept
        return staged

    def start(self, path: str, job: Callable[[Communicator], None]) -> AsyncSave:
        """Run ``job(background communicator)`` on a thread; return its handle."""
        handle = AsyncSave(path, self.comm.rank)
        # Not a daemon: an interpreter that exits finishes the save first.
        thread = threading.Thread(
            target=handle._run, args=(job, self.comm), name="shardwrap-async-save"
        )
        handle._thread = thread
        self.in_flight = handle
        thread.start()
        return handle

    def wait_in_flight(self) -> None:
        """Let the save in flight end; warn (once) of a failure nobody has asked about."""
        handle, self.in_flight = self.in_flight, None
        if handle is None:
            return
        seen = handle.observed
        try:
            handle.wait()
        except CheckpointError as exc:
            # Not raised: a rank that had already read it would go on alone into the next
            # save's collectives; the failed save's handle still raises it.
            if not seen:
                warnings.warn(f"an earlier asynchronous save failed: {exc}", stacklevel=3)
            handle.observed = seen


_SAVERS: weakref.WeakKeyDictionary[nn.Module, AsyncSaver] = weakref.WeakKeyDictionary()


def saver_of(model: nn.Module, world_comm: Communicator) -> AsyncSaver:
    """``model``'s saver; its first call (on every rank of ``world_comm``) makes the group."""
    saver = _SAVERS.get(model)
    if saver is None:
        group = None if world_comm.size == 1 else side_group(world_comm.group)
        saver = AsyncSaver(Communicator(group, CommLedger()))
        _SAVERS[model] = saver
    return saver


def wait_for_previous(model: nn.Module) -> None:
    """Before any save or load of ``model``: let its asynchronous save in flight end."""
    saver = _SAVERS.get(model)
    if saver is not None:
        saver.wait_in_flight()


def existing_saver(model: nn.Module) -> AsyncSaver | None:
    """``model``'s saver if it has made an asynchronous save (its buffers, its group)."""
    return _SAVERS.get(model)
