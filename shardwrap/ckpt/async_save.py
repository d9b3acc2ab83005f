"""Asynchronous checkpoint saves: stage on the caller's thread, write in the background.

[Note: asynchronous saves]
``save_checkpoint(..., asynchronous=True)`` does on the caller's (training) thread only
what must see the state as of the call, and no collective (but the first save's, which
makes the background group): the copy of every tensor the rank saves into the host arena
of its staging plan (:meth:`AsyncSaver.stage`, [Note: staging plans] in staging_plan.py),
a snapshot of the generators and data position, of the param groups' settings and of
``extra``; its argument checks go with them. It then returns an :class:`AsyncSave`, and a
background thread agrees with the other ranks on the save id and on whether every rank
staged (one all-reduce: a rank that could not raises from every rank's ``result()``),
encodes the run record and the rank's description of the model, writes and hashes the
rank's files, gathers every rank's report and lets rank 0 commit the index, then learns
the outcome.

The background collectives run on a gloo group of their own (``comm.groups.side_group``,
created by every rank at its first asynchronous save of the model), so they never run
concurrently with the training's on the same group, and in the same order on every rank:
one save runs at a time, since every save of a model (either kind) first waits for the
one in flight. A failure anywhere raises from every rank's ``result()``, naming the rank
(and the file, for a write that failed).

The arena belongs to the model's saver and is reused while the layout holds: after the
first save a save allocates nothing (it is pinned when the state lives on an accelerator,
so the copies run at full speed). Files are written under temporary names and the index
last, so a process killed in the background write leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import enum
import threading
import warnings
import weakref
from collections.abc import Callable

from torch import nn

from ..comm.collectives import Communicator
from ..comm.groups import side_group
from ..comm.ledger import CommLedger
from .format import CheckpointError
from .slots import ModelSlots
from .staging_plan import StagingPlan, build_plan, observe


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
    """One model's asynchronous saves: staging plan, background group, save in flight."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm  # the background group's (its own ledger: not the training's)
        self.plan: StagingPlan | None = None  # the last layout's ([Note: staging plans])
        self.num_plans = 0  # how many plans were built (a new one per layout change)
        self.in_flight: AsyncSave | None = None

    def stage(self, model: nn.Module, optimizer, slots: ModelSlots) -> StagingPlan:
        """Copy ``model``'s and ``optimizer``'s state into the plan's host arena, as of now
        (a new plan first if the layout changed); the plan, whose items read the copies."""
        key, roots = observe(model, optimizer)
        plan = self.plan
        if plan is None or not plan.fits(key):
            plan = build_plan(model, optimizer, key, roots, plan, slots)
            self.plan, self.num_plans = plan, self.num_plans + 1
        plan.copy(roots)
        return plan

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
    """``model``'s saver if it has made an asynchronous save (its plan, its group)."""
    return _SAVERS.get(model)
