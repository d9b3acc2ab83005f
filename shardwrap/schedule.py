"""Overlap: which all-gather to issue ahead, and how many reductions may be in flight.

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
  when the next unit's reduction is issued (or at the end of backward), so at most one
  flat gradient per root is in flight: gradient memory stays bounded, as ZeRO-2/3 promise.

Prefetching only ever looks one unit ahead, so at most two units are gathered at a time
beyond the ones enclosing the current one (``limit_all_gathers``). Every choice depends
only on the order of forwards, which is the same on every rank, so the collectives stay
in the same order everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .flat_param import FlatParamHandle
from .options import BackwardPrefetch

if TYPE_CHECKING:
    from .hooks import Unit


class Schedule:
    """Prefetch and reduction-overlap decisions for one root's units."""

    def __init__(
        self, *, forward_prefetch: bool, backward_prefetch: BackwardPrefetch | None
    ) -> None:
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        self.previous_forward_order: list[Unit] = []  # the last completed step's order
        self._reducing: list[FlatParamHandle] = []  # reductions issued and not yet waited

    # ------------------------------------------------------------- prefetch
    def after_pre_forward(self, unit: Unit) -> None:
        if not self.forward_prefetch:
            return
        order = self.previous_forward_order
        if unit in order:
            position = order.index(unit)
            if position + 1 < len(order):
                _prefetch(order[position + 1])

    def after_pre_backward(self, unit: Unit, execution_order: list[Unit]) -> None:
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_next_backward(unit, execution_order)

    def after_post_backward(self, unit: Unit, execution_order: list[Unit]) -> None:
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch_next_backward(unit, execution_order)

    def _prefetch_next_backward(self, unit: Unit, execution_order: list[Unit]) -> None:
        from .hooks import TrainingState

        for candidate in reversed(execution_order):
            if candidate is not unit and candidate.state is TrainingState.FORWARD:
                _prefetch(candidate)
                return

    # ----------------------------------------------------------- reductions
    def start_reduce(self, handle: FlatParamHandle) -> None:
        """Issue ``handle``'s reduction after waiting for the one before it."""
        self.finish_reduces()
        handle.start_reduce_grads()
        self._reducing.append(handle)

    def finish_reduces(self) -> None:
        for handle in self._reducing:
            handle.finish_reduce_grads()
        self._reducing.clear()

    def end_step(self, forward_order: list[Unit]) -> None:
        """Remember this step's order; settle reductions and prefetches nobody used."""
        self.finish_reduces()
        self.previous_forward_order = list(forward_order)
        for unit in forward_order:
            handle = unit.handle
            if handle is not None and handle.gather_in_flight:
                handle.unshard()
                handle.reshard(free=unit.strategy.free_after_backward)


def _prefetch(unit: Unit) -> None:
    if unit.handle is not None:
        unit.handle.start_unshard()
