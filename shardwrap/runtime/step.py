"""Per-root step bookkeeping: execution order, end of backward, gradient presence vote.

[Note: gradient presence]
In single-process training a parameter that takes no part in the loss keeps
``grad=None``, so the optimizer leaves it alone (no momentum, no weight decay). A rank
cannot tell that alone: the parameter may have been used by another rank's data. Each
unit therefore reduces zeros for its missing gradients, and once per optimizer-visible
gradient update one small all-reduce (MAX) of per-parameter "had a gradient" flags
decides, for every rank alike, which shard views receive a gradient.

[Note: ZeRO-1 reduces in backward]
ZeRO-1 (``SHARD_OPTIM``) shards only the optimizer state, yet its gradients are reduced
like ZeRO-2's: each unit's reduce-scatter is issued when the unit's backward ends and
overlaps the rest of backward, as DDP's all-reduces do, and the full local gradient is
freed once reduced. Reducing at the optimizer step instead would serialise all gradient
traffic after backward. Under ``no_sync`` full local gradients accumulate on the full
views; the next synchronising backward reduces their sum. If no synchronising backward
follows (``no_sync`` backwards, then ``optimizer.step()``), the optimizer step pre-hook
reduces what they left, so no accumulated gradient is ever dropped.

[Note: microbatched steps]
A pipeline schedule runs several microbatches' forwards and backwards per optimizer step,
in an order of its own (GPipe: all forwards, then all backwards; 1F1B: interleaved). Three
flags, FSDP2's, let it say where a step stands (``ShardedModule.set_*`` sets them):
``sync_grads`` (``set_requires_gradient_sync``; off is ``no_sync``), ``reshard_after_backward``
(off: a unit keeps its gathered parameters after backward, so the next microbatch's
backward, and forward, need no all-gather) and ``is_last_backward`` (off: the step goes on
after the next backward). While ``is_last_backward`` is off a new forward does not abandon
the previous one's gathered parameters, and the end of a backward settles reductions but
neither frees kept units nor replaces the forward order the schedule prefetches by: the
order of the step's first backward (its forwards' order) is kept for its last one.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..base.torch_compat import queue_backward_callback
from ..comm.checks import digest, digest_words, raise_disagreement, words_agree
from ..comm.collectives import Communicator
from ..core.unit import TrainingState, Unit
from ..flat_param import FlatParamHandle
from .schedule import Schedule

NUM_DIGEST_WORDS = 4  # appended to the presence vote: see [Note: rank agreement]
# Runtimes whose ZeRO-1 optimizer hooks are live (not in the registry: it imports this module).
_STEPPING: weakref.WeakSet[StepRuntime] = weakref.WeakSet()


def reduce_deferred_grads_for(optimizer: torch.optim.Optimizer) -> None:
    """Reduce unreduced ZeRO-1 gradients of every root that owns ``optimizer``'s parameters.

    For code holding only an optimizer (a grad scaler): this module knows the runtimes
    whose optimizer hooks are live.
    """
    for runtime in list(_STEPPING):
        if runtime.sync_grads and runtime._owns(optimizer):
            runtime.reduce_deferred_grads()


@dataclass(frozen=True)
class _PresenceVote:
    """A presence vote in flight: its work, the flags it reduces, the handles they cover."""

    work: Any
    flags: torch.Tensor  # int32, one per parameter of ``handles``, in order
    handles: list[FlatParamHandle]

    def finish(self) -> bool:
        """Wait, then hand each handle's reduced gradient to the shard views that got one.

        Returns whether every rank ran the same units ([Note: rank agreement]).
        """
        self.work.wait()
        reduced = self.flags.tolist()
        flags = [bool(f) for f in reduced[:-NUM_DIGEST_WORDS]]
        start = 0
        for handle in self.handles:
            count = len(handle.grads.local_grad_present)
            handle.grads.assign_grads(flags[start : start + count])
            start += count
        return words_agree(reduced[-NUM_DIGEST_WORDS:])


class StepRuntime:
    """State shared by all units of one root ``ShardedModule`` across a training step."""

    def __init__(self, units: list[Unit], world_comm: Communicator, schedule: Schedule) -> None:
        self.units = units
        self.world_comm = world_comm
        self.schedule = schedule
        self.sync_grads = True
        # [Note: microbatched steps]
        self.reshard_after_backward = True
        self.is_last_backward = True
        self._step_order: list[Unit] = []  # forward order of a microbatched step so far
        self.execution_order: list[Unit] = []  # units in first-forward order this step
        # Units run (names, in order) since the last presence vote checked them.
        self.units_run: list[str] = []
        self._finalize_queued = False
        # ZeRO-1: a ``no_sync`` backward left full local gradients that no synchronising
        # backward reduced since; the optimizer step reduces them.
        self.deferred_grads_pending = False
        self._step_hooks: list = []
        self._checked_entries: list[tuple[str, str]] = []  # what the last vote checked
        # id(shard view) -> its handle, for the optimizer step hooks; the views live as long
        # as their handle, so ids stay valid.
        self._handle_of_shard = {
            id(param): u.handle
            for u in units
            if u.handle is not None
            for param in u.handle.shard_params
        }
        self._install_step_post_hook()
        if any(u.strategy.reduces_at_step and u.handle is not None for u in units):
            self._install_optimizer_hooks()
            _STEPPING.add(self)

    # ---------------------------------------------------------------- forward
    def begin_forward(self) -> None:
        """Called by the root before each forward: start a fresh execution order."""
        if not self._finalize_queued:
            self.execution_order.clear()
            for unit in self.units:
                unit.forward_depth = 0  # a forward that raised never ran its post-forward
                if unit.state is not TrainingState.IDLE:
                    self._abandon(unit)

    def _abandon(self, unit: Unit) -> None:
        # A forward whose backward never ran (evaluation with grad enabled, an exception).
        # Local gradients already accumulated stay, as autograd would keep them; only the
        # gathered parameters are released.
        # Mid-step ([Note: microbatched steps]) a unit kept gathered stays so.
        if unit.handle is not None and unit.strategy.free_after_backward:
            unit.handle.reshard(free=self.is_last_backward)
        unit.end_step()

    def record_forward(self, unit: Unit) -> None:
        if unit.state is TrainingState.IDLE and unit not in self.execution_order:
            self.execution_order.append(unit)

    # --------------------------------------------------------------- backward
    def queue_finalize(self) -> None:
        if not self._finalize_queued:
            self._finalize_queued = True
            queue_backward_callback(self.finalize_backward)

    def finalize_backward(self) -> None:
        """End of backward: reduce the units autograd did not reach, then vote on presence."""
        self._finalize_queued = False
        self.units_run.extend(u.name for u in self.execution_order)
        self._update_deferred_pending()
        for unit in reversed(self.execution_order):
            if unit.state in (TrainingState.FORWARD, TrainingState.BACKWARD):
                self.post_backward(unit)
        vote = None
        if self.sync_grads:
            self._check_late_grads(self.units)
            # Every flag is known once the last reduction is issued: the vote goes out now
            # and its round trip overlaps the wait for the reductions still in flight.
            vote = self.start_vote(self.units)
        order = self._order_for_end()
        self.schedule.end_step(order, last=self.is_last_backward, free=self.reshard_after_backward)
        agreed = vote.finish() if vote is not None else True
        for unit in self.units:
            unit.end_step()
        self.execution_order.clear()
        if not agreed:
            self.report_disagreement()

    def post_backward(self, unit: Unit) -> None:
        """Reduce ``unit``'s gradients (unless under ``no_sync``) and reshard it.

        Run by the autograd node on the unit's inputs, or by :meth:`finalize_backward` for
        a unit autograd did not reach (see [Note: when a unit's backward is over]).
        """
        if unit.state is TrainingState.BACKWARD_DONE or unit.state is TrainingState.IDLE:
            return
        handle = unit.handle
        if handle is not None:
            # ZeRO-1 too: see [Note: ZeRO-1 reduces in backward]. A frozen unit has nothing
            # to reduce on any rank (see [Note: frozen units]).
            if self.sync_grads and handle.has_trainable_params:
                self.schedule.reduce_after_backward(unit, self.execution_order)
            handle.reshard(free=unit.strategy.free_after_backward and self.reshard_after_backward)
        unit.finish_backward()
        self.schedule.after_post_backward(unit, self.execution_order)

    def _order_for_end(self) -> list[Unit]:
        """The forward order this backward's end hands the schedule.

        See [Note: microbatched steps]: later backwards of a step record units in backward
        order, so the step's first order is kept for its last backward.
        """
        if not self.is_last_backward:
            self._step_order = self._step_order or list(self.execution_order)
            return self.execution_order
        order, self._step_order = self._step_order or self.execution_order, []
        return order

    def _update_deferred_pending(self) -> None:
        # A synchronising backward reduces only the units it reached; a ZeRO-1 unit it did
        # not reach may still hold gradients from an earlier ``no_sync`` backward. The
        # execution order is the same on every rank, so every rank decides alike.
        if not self.sync_grads:
            self.deferred_grads_pending = True
        elif self.deferred_grads_pending:
            self.deferred_grads_pending = any(
                u.strategy.reduces_at_step and u.handle is not None
                for u in self.units
                if u not in self.execution_order
            )

    def _check_late_grads(self, units: list[Unit]) -> None:
        for unit in units:
            if unit.handle is None or unit not in self.execution_order:
                continue
            late = unit.handle.grads.late_grad_names()
            if late:
                raise RuntimeError(
                    f"rank {self.world_comm.rank}: unit {unit.name!r} received gradients for "
                    f"{late} after it was reduced; a parameter is used outside its unit's "
                    "forward. Wrap the module that uses it, or put both in one unit."
                )

    def vote_and_assign(self, units: list[Unit]) -> None:
        """All-reduce per-parameter presence flags and hand reduced grads to shard views."""
        vote = self.start_vote(units)
        if vote is not None and not vote.finish():
            self.report_disagreement()

    def start_vote(self, units: list[Unit]) -> _PresenceVote | None:
        """Issue the presence vote of ``units`` (see [Note: gradient presence])."""
        handles = [u.handle for u in units if u.handle is not None]
        entries = self._run_entries()
        self.units_run.clear()  # checked now, or never: nothing to vote on (no handles)
        if not handles:
            return None
        self._checked_entries = entries
        words = digest_words(digest(entries))
        flags = torch.tensor(
            [int(f) for h in handles for f in h.grads.local_grad_present] + words,
            dtype=torch.int32,
        )
        work = self.world_comm.all_reduce(flags, purpose="grad_presence", op=dist.ReduceOp.MAX)
        return _PresenceVote(work, flags, handles)

    def _run_entries(self) -> list[tuple[str, str]]:
        return [
            (f"unit #{i + 1} run", f"unit {n or '(root)'!r}") for i, n in enumerate(self.units_run)
        ]

    def report_disagreement(self) -> None:
        """The vote's digests differ: name the first rank and unit run that differ."""
        raise_disagreement(
            self.world_comm, self._checked_entries, "the units run since the last check"
        )

    # ----------------------------------------------------- ZeRO-1 step hooks
    def reduce_deferred_grads(self) -> None:
        """ZeRO-1: reduce full local gradients that ``no_sync`` backwards left, before a step.

        A no-op when every backward since the last reduction synchronised (the usual case:
        gradients were reduced during backward), on a second call, or before any backward,
        so gradient clipping can flush early without double counting.
        See [Note: ZeRO-1 reduces in backward].
        """
        if not self.deferred_grads_pending:
            return
        self.deferred_grads_pending = False
        units = [
            u
            for u in self.units
            if u.strategy.reduces_at_step and u.handle is not None and u.handle.has_trainable_params
        ]
        # Backward order, as ZeRO-2/3 reduce, so buckets fill the same way.
        self.schedule.reduce_all([u.handle for u in reversed(units)])  # type: ignore[misc]
        self.vote_and_assign(units)

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(
            id(p) in self._handle_of_shard for g in optimizer.param_groups for p in g["params"]
        )

    def _install_optimizer_hooks(self) -> None:
        ref = weakref.ref(self)

        def before_step(optimizer, args, kwargs):
            runtime = ref()
            if runtime is not None and runtime.sync_grads and runtime._owns(optimizer):
                runtime.reduce_deferred_grads()

        self._step_hooks.append(register_optimizer_step_pre_hook(before_step))

    def _install_step_post_hook(self) -> None:
        ref = weakref.ref(self)

        def after_step(optimizer, args, kwargs):
            runtime = ref()
            if runtime is not None:
                runtime.note_step(optimizer)

        self._step_hooks.append(register_optimizer_step_post_hook(after_step))

    def note_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` stepped: every handle with a shard view it held and stepped (one
        with a gradient: torch's optimizers leave the others alone) has a stale gathered
        copy ([Note: optimizer steps that bump no version] in ``flat_param.py``). Frozen
        units are not gathered again for nothing.
        """
        stepped: dict[int, FlatParamHandle] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                handle = self._handle_of_shard.get(id(param))
                if handle is not None and param.grad is not None:
                    stepped[id(handle)] = handle
        for handle in stepped.values():
            handle.note_shard_updated()

    def remove_hooks(self) -> None:
        for h in self._step_hooks:
            h.remove()
        self._step_hooks.clear()
        _STEPPING.discard(self)

    def __del__(self) -> None:
        # At interpreter exit this module's globals may be gone already (``_STEPPING``,
        # reached last in ``remove_hooks``): the hooks are removed before it is.
        try:
            self.remove_hooks()
        except Exception:
            pass

    # ------------------------------------------------------------------ misc
    @contextlib.contextmanager
    def no_sync(self):
        previous = self.sync_grads
        self.sync_grads = False
        try:
            yield
        finally:
            self.sync_grads = previous
