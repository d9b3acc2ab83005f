"""One root's step: every moment of a unit's step, the end of backward, the presence vote.

A unit passes, in order, through ``StepRuntime.pre_forward``, ``post_forward``,
``pre_backward``, ``post_backward`` and, once per backward, ``finalize_backward`` (which
ends the step, unless the caller finalizes it: runtime/manual_finalization.py); the
optimizer step through core/optimizer_step.py (docs/architecture.md lists what each
calls). This module is the only caller of ``unshard``/``reshard``; the schedule answers
what to prefetch, what stays gathered and when to wait for reductions, and ``Unit``
changes its own fields.

The free rule (what a unit gives up, and when) is runtime/free_rule.py; the presence vote
runtime/presence.py; ZeRO-1's reductions left for the optimizer step
runtime/deferred_grads.py ([Note: ZeRO-1 reduces in backward]).

[Note: the post-optimizer event]
FSDP2's ``set_post_optim_event(event)`` makes the next root forward's all-gathers wait for
``event`` (recorded after the optimizer step) instead of for all the current stream's
work, then drops it, so each step needs a new one. The engine issues its gathers from the
current stream (NCCL's stream follows it; gloo runs them on its threads once the CPU got
there), so the optimizer step is always finished before them; :meth:`begin_forward` also
makes the current stream wait for the event (``event.wait()``, before the forward's first
gather), which on an accelerator adds that dependency and on the CPU, where ops are
synchronous and a CPU ``torch.Event`` records nothing, waits for nothing, as FSDP2's CPU
streams do. Either way the event is dropped there, as FSDP2 drops it.

[Note: a step abandoned by an exception]
An exception in a forward leaves units gathered and entered; the next root forward
abandons them ([Note: the free rule]). One in a backward also drops autograd's queued
end-of-backward callback, so :meth:`finalize_backward` never runs and the next forward
would not start a fresh step. :meth:`reset_iter_state` (FSDP2's ``reset_iter_state``, on the
root) recovers from either, as FSDP2's does: it waits for every collective in flight
(every rank must call it, as every rank issued them), drops the reductions issued and the
reduced gradients not yet assigned (the failed step's gradients are lost; kept HSDP sums
too), frees every unit's gathered parameters and puts every unit and the step's order
back to the start. The gradients it keeps depend on the torch release, as FSDP2's do:
from 2.15 (``drop_grads``) none, the shard views' ``.grad`` and the local gradients on the
full views dropped too; before 2.15 the local gradients a unit accumulated before the
failure without reducing them yet (the root's, when backward failed in a block) stay, and
the next backward adds to them, while FSDP2 has assigned to ``.grad`` the gradients of the
units it reduced before the failure and shardwrap drops those: call
``optimizer.zero_grad()`` after the reset, as the retried step must start from none.

[Note: units not gathered for backward]
A unit whose parameters' values its backward does not read (an embedding's backward needs
the indices and the table's shape only; a linear layer's on inputs needing no gradient, its
inputs only) may be told not to be gathered for backward (FSDP2's
``set_unshard_in_backward(False)``): its pre-backward gathers nothing, no other unit
prefetches it for backward (``schedule._reached_by_backward``), and its full views keep
the storage they had after forward (none, if it resharded then). Autograd still
accumulates the local gradients on the full views, which the unit's post-backward reduces
as any unit's. Told so of a unit whose backward does read them, backward reads released
storage and fails, as under FSDP2.

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

import torch

from ..base.pages import release_resident
from ..base.torch_compat import queue_backward_callback
from ..comm.collectives import Communicator
from ..core import optimizer_step
from ..core.optimizer_step import Phase
from ..core.unit import TrainingState, Unit
from ..flat_param import FlatParamHandle
from .deferred_grads import STEPPING, reduce_deferred_grads_for, still_pending
from .free_rule import Moment, Release, release_rule
from .gather_bucket import FusedGather
from .manual_finalization import ManualFinalization, PendingReduction
from .presence import NUM_DIGEST_WORDS, PresenceCheck
from .schedule import Prefetch, Schedule

__all__ = ["NUM_DIGEST_WORDS", "StepRuntime", "reduce_deferred_grads_for", "regather"]


def regather(handle: FlatParamHandle) -> None:
    """Gather ``handle`` again outside a step: ``summon_full_params`` wrote edits into its
    shard while it showed gathered parameters, which must show the edits."""
    handle.unshard()


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
        # The presence vote and what it checks ([Note: gradient presence])
        self.presence = PresenceCheck(world_comm)
        # From the first pre-backward until the end-of-backward callback (still set after a
        # backward that raised, until reset_iter_state); FSDP1's training_state reads it.
        self.backward_in_flight = False
        # [Note: manual backward finalization] in runtime/manual_finalization.py
        self.manual = ManualFinalization()
        self.has_run_forward = False  # the root ran a forward (FSDP2: lazily initialised)
        # An event the next forward's gathers wait for, then dropped ([Note: the post-optimizer
        # event]); None: they follow the current stream's work, as every collective does.
        self.post_optim_event: torch.Event | None = None
        # ZeRO-1: a ``no_sync`` backward left full local gradients that no synchronising
        # backward reduced since; the optimizer step reduces them.
        self.deferred_grads_pending = False
        # id(shard view) -> its handle, for the optimizer step hooks; the views live as long
        # as their handle, so ids stay valid (index_shard_views again if a door swaps them).
        self._handle_of_shard: dict[int, FlatParamHandle] = {}
        self.index_shard_views()
        # [Note: one optimizer-step dispatcher] in core/optimizer_step.py
        actions = {Phase.NOTE_STALE: _note_stale}
        if any(u.strategy.reduces_at_step and u.handle is not None for u in units):
            actions[Phase.FLUSH_DEFERRED_GRADS] = _flush_deferred
            STEPPING.add(self)
        optimizer_step.join(self, StepRuntime.owns, actions)

    # ---------------------------------------------------------------- forward
    def begin_forward(self) -> None:
        """Called by the root before each forward: wait for a post-optimizer event, start
        a fresh execution order."""
        self.manual.check_no_pending("forward")
        self.has_run_forward = True
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None:  # before any gather of this forward
            event.wait()
        if not self.backward_in_flight:
            self.execution_order.clear()
            for unit in self.units:
                unit.clear_forward_depth()
                if unit.state is not TrainingState.IDLE:
                    self._abandon(unit)

    def _abandon(self, unit: Unit) -> None:
        # A forward whose backward never ran (evaluation with grad enabled, an exception).
        # Local gradients already accumulated stay, as autograd would keep them; only the
        # gathered parameters are released.
        self._release_at(Moment.ABANDONED, unit)
        unit.end_step()

    def pre_forward(self, unit: Unit) -> None:
        """Pre-forward: gather ``unit`` (or wait for its prefetch), prefetch what follows."""
        self.record_forward(unit)
        unit.enter_forward()
        if unit.handle is not None:
            self._start_gather(unit, self.schedule.forward_upcoming(unit))
            unit.handle.unshard()
        self._prefetch_all(self.schedule.prefetches_after_forward(unit))
        if unit.state is TrainingState.IDLE:
            unit.start_forward()
            unit.set_expects_backward(False)

    def post_forward(self, unit: Unit, *, training: bool, backward_expected: bool) -> None:
        """Post-forward: release ``unit`` by the free rule ([Note: the free rule]).

        ``backward_expected``: backward may reach the unit (its outputs were hooked, or
        forward ran without grad and a reentrant checkpoint may run it again).
        """
        outermost = unit.leave_forward()
        if outermost:
            keep = self.schedule.keeps_gathered_after_forward(unit)
            self._release_at(Moment.POST_FORWARD, unit, training=training, kept=keep)
        if backward_expected:
            unit.set_expects_backward(True)

    def record_forward(self, unit: Unit) -> None:
        if unit.state is TrainingState.IDLE and unit not in self.execution_order:
            self.execution_order.append(unit)

    # --------------------------------------------------------------- backward
    def pre_backward(self, unit: Unit) -> None:
        """Pre-backward: gather ``unit`` again (or wait for its prefetch), prefetch the next."""
        self.queue_finalize()
        if unit.state is TrainingState.IDLE:
            # A further backward through a retained graph (``retain_graph=True``): this
            # unit's step was finalised already, so enter it as a new one.
            self.record_forward(unit)
            unit.start_forward()
        if unit.state in (TrainingState.FORWARD, TrainingState.BACKWARD_DONE):
            # [Note: units not gathered for backward]
            if unit.handle is not None and unit.unshard_in_backward:
                self._start_gather(
                    unit, self.schedule.backward_upcoming(unit, self.execution_order)
                )
                unit.handle.unshard()
            unit.start_backward()
            self._prefetch_all(
                self.schedule.prefetches_in_backward(unit, self.execution_order, done=False)
            )

    def queue_finalize(self) -> None:
        if not self.backward_in_flight:
            self.backward_in_flight = True
            self.manual.begin_backward()
            queue_backward_callback(self.finalize_backward)

    def finalize_backward(self) -> None:
        """End of backward (autograd's callback): the step's end, or, under manual
        finalization, this backward's ([Note: manual backward finalization])."""
        self.backward_in_flight = False
        if self.manual.active:
            self._end_backward(last=False, manual=True)
        else:
            self._end_backward(last=self.is_last_backward)

    def _end_backward(self, *, last: bool, manual: bool = False) -> None:
        """Reduce the units autograd did not reach (``manual``: leave them waiting while
        synchronising), vote on presence, settle; ``last``: the step ends."""
        self.presence.note_run(self.execution_order)
        self.deferred_grads_pending = still_pending(
            self.deferred_grads_pending,
            sync_grads=self.sync_grads,
            units=self.units,
            reached=self.execution_order,
        )
        for unit in reversed(self.execution_order):
            if unit.state not in (TrainingState.FORWARD, TrainingState.BACKWARD):
                continue
            if manual and self.sync_grads:
                self.manual.wait_for(unit)  # gathered, its gradients local, until finalized
            else:
                self.post_backward(unit)
        vote = None
        if self.sync_grads:
            reached = [u for u in self.units if u in self.execution_order]
            self.presence.check_late_grads([u for u in reached if u not in self.manual.waiting])
            # Every flag is known once the last reduction is issued: the vote goes out now
            # and its round trip overlaps the wait for the reductions still in flight.
            vote = self.presence.start([u.handle for u in self.units if u.handle is not None])
        order = self._order_for_end(last)
        for unit in self.schedule.end_step(order, last=last):
            self._settle(unit, last)
        agreed = vote.finish() if vote is not None else True
        for unit in self.units:
            unit.end_step()
        self.execution_order.clear()
        if last:
            self.manual.end_step()
        if not agreed:
            self.presence.report_disagreement()

    def start_finalize(self) -> PendingReduction:
        """FSDP2's ``finalize_backward``: issue the reductions of the units waiting for it;
        :meth:`finish_finalize` ends the step ([Note: manual backward finalization])."""
        self.manual.check_finalize(
            backward_running=self.backward_in_flight, units=self.units, sync_grads=self.sync_grads
        )
        ends_step = self.manual.active is not None or bool(self.manual.waiting)
        waiting = self.manual.take_waiting(sync=self.sync_grads)
        handles = [u.handle for u in waiting if u.handle and u.handle.has_trainable_params]
        for index, handle in enumerate(handles):
            self.schedule.start_reduce(handle, handles[index + 1 :])
        for unit in waiting if self.reshard_after_backward else ():
            self._release_at(Moment.POST_BACKWARD, unit)
        pending = PendingReduction(ends_step=ends_step)
        self.manual.pending = pending
        return pending

    def finish_finalize(self, pending: PendingReduction) -> None:
        """Wait for what :meth:`start_finalize` issued, assign ``.grad``, end the step."""
        if self.manual.pending is not pending:
            raise RuntimeError("This gradient reduction handle was invalidated")
        self.manual.pending = None
        if pending.ends_step:
            self._end_backward(last=True)

    def post_backward(self, unit: Unit) -> None:
        """Reduce ``unit``'s gradients (unless under ``no_sync``) and reshard it.

        Run by the autograd node on the unit's inputs, or by :meth:`finalize_backward` for
        a unit autograd did not reach (see [Note: when a unit's backward is over]).
        """
        if unit.state is TrainingState.BACKWARD_DONE or unit.state is TrainingState.IDLE:
            return
        # ZeRO-1 too: see [Note: ZeRO-1 reduces in backward]. A frozen unit has nothing to
        # reduce on any rank (see [Note: frozen units]).
        if self.sync_grads and unit.handle is not None and unit.handle.has_trainable_params:
            self.schedule.reduce_after_backward(unit, self.execution_order)
            self.manual.reduced(unit)
        elif self.manual.active and not self.sync_grads:  # a later finalize_backward reduces
            self.manual.wait_for(unit)
        self._release_at(Moment.POST_BACKWARD, unit)
        unit.finish_backward()
        self._prefetch_all(
            self.schedule.prefetches_in_backward(unit, self.execution_order, done=True)
        )

    # ------------------------------------------------------------ a user's calls
    def unshard_unit(self, unit: Unit, *, wait: bool = True) -> None:
        """``FSDPModule.unshard``: gather ``unit`` (``wait=False``: only issue the gather)."""
        if unit.handle is not None and wait:
            unit.handle.unshard()
        elif unit.handle is not None:
            unit.handle.start_unshard()

    def reshard_unit(self, unit: Unit) -> None:
        """``FSDPModule.reshard``: release ``unit`` as the free rule says for a user's call."""
        self._release_at(Moment.USER_CALL, unit)

    def reset_iter_state(self, *, drop_grads: bool = False) -> None:
        """Put every unit back to the start of a step after an exception aborted a forward
        or a backward ([Note: a step abandoned by an exception]); ``drop_grads``: every
        gradient too, local and reduced."""
        self.schedule.discard_reductions()
        for unit in self.units:
            if unit.handle is not None:
                unit.handle.grads.discard_reductions(drop_grads=drop_grads)
                self._release_at(Moment.USER_CALL, unit)  # waits for a gather in flight
            unit.clear_forward_depth()
            unit.end_step()
        self.execution_order.clear()
        self._step_order = []
        self.backward_in_flight = False
        self.manual.reset()

    # ------------------------------------------------------------ gathers ahead
    def _prefetch_all(self, plan: list[Prefetch]) -> None:
        for prefetch in plan:
            self._prefetch(prefetch.unit, prefetch.upcoming)

    def _prefetch(self, unit: Unit, upcoming: list[Unit]) -> None:
        """Issue ``unit``'s all-gather ahead of use ([Note: prefetch and overlap])."""
        if unit.handle is not None:
            self._start_gather(unit, upcoming)  # the unit alone when no bucket forms
            unit.handle.start_unshard()

    def _start_gather(self, unit: Unit, upcoming: list[Unit]) -> None:
        """Issue one gather for ``unit`` and those of ``upcoming`` it fuses with, if any
        ([Note: all-gather buckets]); otherwise leave ``unit`` to gather alone."""
        members = self.schedule.bucket_members(unit, upcoming)
        if len(members) > 1:
            FusedGather(members)  # every member now has its gather in flight

    def _settle(self, unit: Unit, last: bool) -> None:
        """End of backward: land a gather nobody waited for (a prefetch or a bucket's), then
        release ``unit`` by the free rule; ``last``: the step ends."""
        landed = unit.handle is not None and unit.handle.gather_in_flight
        if landed:
            unit.handle.unshard()  # type: ignore[union-attr]
        self._release_at(Moment.END_OF_BACKWARD, unit, landed=landed, last_backward=last)

    def _release_at(self, moment: Moment, unit: Unit, **facts: bool) -> None:
        """Give up what the free rule says ``unit`` gives up at ``moment``; the one place
        that reshards or drops a kept shard's pages. ``facts`` may say ``last_backward``
        (default: :attr:`is_last_backward`)."""
        facts.setdefault("last_backward", self.is_last_backward)
        release = release_rule(
            moment, unit, reshard_after_backward=self.reshard_after_backward, **facts
        )
        if release is Release.PAGES:
            release_resident(unit.handle.flat_shard)  # type: ignore[union-attr]
        elif release is not Release.KEEP:
            unit.handle.reshard(  # type: ignore[union-attr]
                free=release is Release.FREE, stale=release is Release.KEEP_STORAGE
            )

    def _order_for_end(self, last: bool) -> list[Unit]:
        """The forward order this backward's end hands the schedule (``last``: the step's).

        See [Note: microbatched steps]: later backwards of a step record units in backward
        order, so the step's first order is kept for its last backward.
        """
        if not last:
            self._step_order = self._step_order or list(self.execution_order)
            return self.execution_order
        order, self._step_order = self._step_order or self.execution_order, []
        return order

    def vote_and_assign(self, units: list[Unit]) -> None:
        """All-reduce per-parameter presence flags and hand reduced grads to shard views."""
        self.presence.vote_and_assign([u.handle for u in units if u.handle is not None])

    # ------------------------------------------------------ the optimizer step
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

    def index_shard_views(self) -> None:
        """Know each unit's shard views; again after a door replaced them (the FSDP2 door's
        DTensors), or the optimizer step would miss their handles."""
        units = [u for u in self.units if u.handle is not None]
        self._handle_of_shard = {id(p): u.handle for u in units for p in u.handle.shard_params}

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` holds a shard view of one of this root's units."""
        return any(
            id(p) in self._handle_of_shard for g in optimizer.param_groups for p in g["params"]
        )

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
        """Take no more part in optimizer steps (an enclosing root adopted the units)."""
        STEPPING.discard(self)
        optimizer_step.leave(self)

    # ------------------------------------------------------------------ misc
    @contextlib.contextmanager
    def no_sync(self):
        previous = self.sync_grads
        self.sync_grads = False
        try:
            yield
        finally:
            self.sync_grads = previous


def _flush_deferred(runtime: StepRuntime, optimizer, args, kwargs) -> None:
    if runtime.sync_grads:
        runtime.reduce_deferred_grads()


def _note_stale(runtime: StepRuntime, optimizer, args, kwargs) -> None:
    runtime.note_step(optimizer)
