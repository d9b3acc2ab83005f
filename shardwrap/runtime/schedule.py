"""Overlap: which all-gather to issue ahead, and how many reductions may be in flight.

The schedule answers the step runtime's questions (what to prefetch after a unit, what a
gather takes along, what stays gathered after forward, which units the end of backward
settles) and owns the reductions in flight (issued, bucketed, waited for as late as
memory allows); it never gathers, shows or frees parameters (runtime/step.py does).

[Note: prefetch and overlap]
Collectives on gloo run on the process group's own threads and on CUDA on NCCL's stream,
so an all-gather issued before it is needed, and a reduction waited for only later, both
run while this rank computes. The schedule decides:

* forward prefetch (``forward_prefetch=True``): when a unit starts its forward, issue the
  all-gather of the unit that followed it in the previous step's forward order;
* backward prefetch (``BACKWARD_PRE``, the default): when a unit is gathered for backward,
  issue the all-gather of the unit whose backward comes next (the previous one in forward
  order that has not run backward yet); ``BACKWARD_POST`` issues it once the current
  unit's backward is done instead, holding one gathered unit less at a time;
* reductions: a unit's gradient reduction is issued when its backward ends and waited for
  as late as memory allows (see [Note: reductions in flight]).

[Note: reductions in flight]
Waiting for a reduction blocks this rank's backward until its peers have caught up, so
every wait is a synchronisation point that costs scheduling jitter, and on CPU the
collective competes for the same cores anyway. Reductions are therefore waited for as
late as memory allows, always oldest first, at points fixed by the order of backward
alone (never by timing), so every rank waits, and issues the replica all-reduce of
hybrid strategies, at the same place:

* an all-reduce in place (one shard: data parallel) holds nothing beyond the gradient
  itself, so these are waited for only at the end of backward, as DDP waits for its
  buckets;
* a reduce-scatter holds its unit's full flat gradient until it is done. At most
  ``MAX_SHARDED_REDUCES_IN_FLIGHT`` are in flight; issuing one more first waits for the
  oldest, so gradient memory stays bounded, as ZeRO-1/2/3 promise. (Two in flight gave
  no consistent gain on the benchmark's shared 2-core machine, so the bound stays one.)

Prefetching looks one unit ahead, so at most two units are gathered at a time beyond the
ones enclosing the current one (``limit_all_gathers``), with one exception:

[Note: prefetching units kept to backward]
Units that stay gathered from forward into backward (SHARD_GRAD_OP, SHARD_OPTIM, a root
kept by ``set_reshard_after_forward(False)``) will all be gathered by the end of forward
whatever the schedule, so their memory is committed for the step anyway. When such a unit
starts its forward, the all-gathers of the run of such units after it are all issued at
once: the process group then works through them back to back instead of waiting for the
next unit's forward to ask (on the 5m benchmark model, 2 ranks, forward 44.6 -> 40.8 ms for
SHARD_GRAD_OP and 46.0 -> 39.6 ms for SHARD_OPTIM, medians of 30 interleaved steps; no gain
measured on 30m). A unit that frees after forward ends the run, so FULL_SHARD keeps its
one-ahead prefetch.

[Note: the last unit of forward stays gathered]
Backward starts with the unit whose forward started last, so freeing it after forward
only to gather it again at once costs an all-gather and saves no peak memory: backward
holds it (and the next unit's prefetch) right away. The unit that came last in the
previous step's forward order therefore keeps its gathered parameters from forward into
backward, as torchtitan configures FSDP2 by hand. An explicit
``set_reshard_after_forward`` on the unit wins, and the first step (no order yet)
reshards as usual. On the 5m benchmark model (2 ranks, FULL_SHARD, 30 interleaved steps,
two runs) the step went from 140.6 to 135.6 and from 138.5 to 136.1 ms.

[Note: explicit prefetch]
FSDP2's ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` name,
per unit, the units whose all-gathers to issue once it is gathered for forward (after
its pre-forward gather) or for backward (after its pre-backward gather). A unit's list
replaces the schedule's own choice for that unit and pass, as in FSDP2 (an empty list:
no prefetch). Only units that will still be gathered for that pass are issued: in
forward those that have not run yet, in backward those whose backward is still to come
and will be reached, so no prefetched unit is left gathered past the step. What the lists
say is the same on every rank (set by the same script), so the order stays agreed.

Every choice depends only on the order of forwards, which is the same on every rank, so
the collectives stay in the same order everywhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.grad_buffers import PlanBuffers, ScratchPool
from ..core.unit import TrainingState, Unit
from ..flat_param import FlatParamHandle
from ..options import BackwardPrefetch
from . import gather_bucket
from .reduce_bucket import ReduceBucket

# Unit states for _backward_next: backward not started yet / gradients not reduced yet.
_NOT_STARTED = (TrainingState.FORWARD,)
_NOT_REDUCED = (TrainingState.FORWARD, TrainingState.BACKWARD)

# Reduce-scatters in flight at once, each holding its unit's full flat gradient; see
# [Note: reductions in flight].
MAX_SHARDED_REDUCES_IN_FLIGHT = 1

# Bucket budget of data-parallel units (in-place all-reduces) unless
# ``set_reduce_bucket_size`` says otherwise: DDP's ``bucket_cap_mb``. Sharded units reduce
# alone by default. See [Note: default reduce buckets] in runtime/reduce_bucket.py.
DEFAULT_IN_PLACE_BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class Prefetch:
    """A gather to issue ahead: ``unit``'s, fused with those of ``upcoming`` that fit a bucket."""

    unit: Unit
    upcoming: list[Unit]


class Schedule:
    """Prefetch and reduction-overlap decisions for one root's units."""

    def __init__(
        self, *, forward_prefetch: bool, backward_prefetch: BackwardPrefetch | None
    ) -> None:
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        # Set by set_reduce_bucket_size (0: each unit reduces alone); None: the default,
        # see [Note: default reduce buckets] and [Note: reduce buckets].
        self.reduce_bucket_bytes: int | None = None
        self.all_gather_bucket_bytes = 0  # 0: each unit gathers alone; [Note: all-gather buckets]
        self.previous_forward_order: list[Unit] = []  # the last completed step's order
        self._reducing: list[FlatParamHandle] = []  # reductions issued and not yet waited
        self._bucket = ReduceBucket()  # units waiting to be reduced together
        self._issued_buckets: list[ReduceBucket] = []  # fused reductions not yet waited
        self.max_sharded_reduces_in_flight = MAX_SHARDED_REDUCES_IN_FLIGHT
        # Reduce-scatter inputs, reused from step to step: those in flight and the one
        # being filled ([Note: reusing the data-parallel gradient buffer]).
        self.scratch = ScratchPool(capacity=self.max_sharded_reduces_in_flight + 1)
        # The buffers of in-place buckets, by plan ([Note: in-place buckets]).
        self.bucket_slots = PlanBuffers()

    # ------------------------------------------------------------- prefetch
    def prefetches_after_forward(self, unit: Unit) -> list[Prefetch]:
        """The gathers to issue ahead once ``unit`` is gathered for forward, in order."""
        if unit.forward_prefetch_targets is not None:  # [Note: explicit prefetch]
            return [Prefetch(t, []) for t in unit.forward_prefetch_targets if _idle(t)]
        order = self.previous_forward_order
        if not self.forward_prefetch or unit not in order:
            return []
        position = order.index(unit)
        after_next = _not_run_yet(order[position + 2 :])
        plan = [Prefetch(order[position + 1], after_next)] if position + 1 < len(order) else []
        if not unit.reshard_after_forward:  # [Note: prefetching units kept to backward]
            for later in after_next:
                if later.reshard_after_forward:
                    break
                plan.append(Prefetch(later, []))
        return plan

    def keeps_gathered_after_forward(self, unit: Unit) -> bool:
        """Whether ``unit`` skips its reshard after forward though its strategy frees then.

        See [Note: the last unit of forward stays gathered].
        """
        order = self.previous_forward_order
        return bool(order) and order[-1] is unit and unit.reshard_after_forward_override is None

    def prefetches_in_backward(
        self, unit: Unit, execution_order: list[Unit], *, done: bool
    ) -> list[Prefetch]:
        """The gather to issue ahead once ``unit`` is gathered for backward (``done=False``:
        ``BACKWARD_PRE``) or its backward is over (``done=True``: ``BACKWARD_POST``)."""
        if unit.backward_prefetch_targets is not None:  # [Note: explicit prefetch]
            targets = unit.backward_prefetch_targets
            coming = [t for t in _reached_by_backward(targets) if t.state in _NOT_STARTED]
            return [] if done else [Prefetch(t, []) for t in coming]
        wanted = BackwardPrefetch.BACKWARD_POST if done else BackwardPrefetch.BACKWARD_PRE
        if self.backward_prefetch is not wanted:
            return []
        upcoming = _reached_by_backward(_backward_next(unit, execution_order))
        return [Prefetch(upcoming[0], upcoming[1:])] if upcoming else []

    # ------------------------------------------------------ all-gather buckets
    def forward_upcoming(self, unit: Unit) -> list[Unit]:
        """The units a forward gather of ``unit`` may take along: those that followed it."""
        order = self.previous_forward_order
        return _not_run_yet(order[order.index(unit) + 1 :]) if unit in order else []

    def backward_upcoming(self, unit: Unit, execution_order: list[Unit]) -> list[Unit]:
        """The units a backward gather of ``unit`` may take along: whose backward is next."""
        return _reached_by_backward(_backward_next(unit, execution_order))

    def bucket_members(self, unit: Unit, upcoming: list[Unit]) -> list[FlatParamHandle]:
        """The handles ``unit``'s gather fuses with ``upcoming``'s (one or none: it goes alone)."""
        if self.all_gather_bucket_bytes <= 0 or not gather_bucket.needs_gather(unit.handle):
            return []
        handles = (u.handle for u in upcoming if u.handle is not None)
        return gather_bucket.collect(unit.handle, handles, self.all_gather_bucket_bytes)

    # ----------------------------------------------------------- reductions
    def reduce_after_backward(self, unit: Unit, execution_order: list[Unit]) -> None:
        """Issue the reduction of ``unit``, whose backward just ended."""
        upcoming: list[FlatParamHandle] = []
        if self.bucket_budget(unit.handle) > 0:  # type: ignore[arg-type]
            later = _backward_next(unit, execution_order, _NOT_REDUCED)
            # [Note: frozen units]: those never reduce, so a plan must not wait for them
            upcoming = [u.handle for u in later if u.handle and u.handle.has_trainable_params]
        self.start_reduce(unit.handle, upcoming)  # type: ignore[arg-type]

    def start_reduce(
        self, handle: FlatParamHandle, upcoming: Sequence[FlatParamHandle] = ()
    ) -> None:
        """Issue ``handle``'s reduction (alone, or as part of a bucket).

        ``upcoming``: the handles whose reductions come next, in order (plans in-place
        buckets, see [Note: in-place buckets]).
        """
        if self._bucket.handles and not self._bucket.accepts(handle):
            self.flush_bucket()
        budget = self.bucket_budget(handle)
        if budget <= 0:
            if not handle.grads.reduces_in_place:
                self._wait_for_sharded_room()
            handle.grads.start_reduce_grads(self.scratch, handle.user_comms.reduce_scatter)
            self._reducing.append(handle)
            return
        if not self._bucket.handles:
            self._bucket = ReduceBucket.opened_by(
                handle, list(upcoming), budget, self.bucket_slots.for_plan
            )
        self._bucket.add(handle)
        if self._bucket.is_full(budget):
            self.flush_bucket()

    def bucket_budget(self, handle: FlatParamHandle) -> int:
        """The reduce bucket budget, in bytes, for ``handle`` (0: it reduces alone)."""
        if handle.user_comms.reduce_scatter is not None:
            return 0  # a user's reduce-scatter reduces its unit alone, as FSDP2's group
        if self.reduce_bucket_bytes is not None:
            return self.reduce_bucket_bytes
        return DEFAULT_IN_PLACE_BUCKET_BYTES if handle.grads.reduces_in_place else 0

    def flush_bucket(self) -> None:
        """Issue the collective of the units collected so far."""
        if not self._bucket.handles:
            return
        if not self._bucket.in_place:  # bounds the memory of concatenated inputs
            self.finish_reduces()
        self._bucket.issue()
        self._issued_buckets.append(self._bucket)
        self._bucket = ReduceBucket()

    def _wait_for_sharded_room(self) -> None:
        # Oldest first, so every rank waits (and issues replica all-reduces) alike.
        sharded = [h for h in self._reducing if not h.grads.reduces_in_place]
        while len(sharded) >= self.max_sharded_reduces_in_flight:
            oldest = sharded.pop(0)
            oldest.grads.finish_reduce_grads()
            self._reducing.remove(oldest)

    def finish_reduces(self) -> None:
        for handle in self._reducing:
            handle.grads.finish_reduce_grads()
        self._reducing.clear()
        for bucket in self._issued_buckets:
            bucket.finish()
        self._issued_buckets.clear()

    def discard_reductions(self) -> None:
        """Wait for every reduction in flight and drop it, and the bucket being filled
        unissued (a failed step: [Note: a step abandoned by an exception] in
        runtime/step.py)."""
        for handle in self._reducing:
            handle.grads.discard_reductions()
        self._reducing.clear()
        for bucket in self._issued_buckets:
            bucket.discard()
        self._issued_buckets.clear()
        self._bucket = ReduceBucket()

    def reduce_all(self, handles: list[FlatParamHandle]) -> None:
        """Reduce ``handles`` now (ZeRO-1 at the optimizer step), bucketed as configured."""
        for index, handle in enumerate(handles):
            self.start_reduce(handle, handles[index + 1 :])
        self.flush_bucket()
        self.finish_reduces()

    def end_step(self, forward_order: list[Unit], *, last: bool = True) -> list[Unit]:
        """Remember this step's order, settle reductions; the units the step runtime then
        settles (lands the gathers nobody used, frees by its rule).

        ``last=False``: a backward that does not end a microbatched step ([Note:
        microbatched steps] in runtime/step.py): reductions settle, the order is not
        replaced, and only this step's units are settled.
        """
        self.flush_bucket()
        self.finish_reduces()
        if not last:
            return list(forward_order)
        self.bucket_slots.end_step()
        # A bucket may have gathered units from the last order that this step did not run.
        touched = list(dict.fromkeys([*forward_order, *self.previous_forward_order]))
        self.previous_forward_order = list(forward_order)
        return touched


def _idle(unit: Unit) -> bool:
    return unit.state is TrainingState.IDLE


def _not_run_yet(units: list[Unit]) -> list[Unit]:
    """The leading ``units`` that have not run this step.

    A forward re-run in backward (activation checkpointing) must not bucket the units
    after it: their backward is over.
    """
    return list(itertools.takewhile(_idle, units))


def _backward_next(
    unit: Unit, execution_order: list[Unit], states: tuple[TrainingState, ...] = _NOT_STARTED
) -> list[Unit]:
    """The units in ``states`` other than ``unit``, in the order backward reaches them.

    By default those whose backward is still to come after ``unit``'s; with
    :data:`_NOT_REDUCED` also those whose backward has started but not ended (an
    enclosing unit, the root), which reduce after ``unit``.
    """
    return [u for u in reversed(execution_order) if u is not unit and u.state in states]


def _reached_by_backward(units: list[Unit]) -> list[Unit]:
    """The ``units`` that backward will gather: see [Note: frozen units] in hooks.py and
    [Note: units not gathered for backward] in runtime/step.py."""
    return [u for u in units if u.expects_backward and u.unshard_in_backward]
