"""Manual backward finalization: the end of a step run when the caller says, not autograd.

[Note: manual backward finalization]
By default the end of every backward (autograd's queued callback) ends the step: the units
autograd did not reach are reduced, the reductions waited for, the presence vote assigns
``.grad`` and the units are settled ([Note: the free rule]). FSDP2's
``set_manual_backward_finalization(True)`` (torch 2.15, on the root) hands the step's end
to the caller: each backward's callback then ends that backward only, as a backward with
``set_is_last_backward(False)`` does (the units that autograd reached, and reduced, get
their ``.grad``; kept units stay gathered), and leaves the units whose local gradients are
not reduced yet waiting: those autograd did not reach (the root, whose inputs need no
gradient) while gradients are synchronised, and those whose backward ran without a sync.
``finalize_backward()`` then reduces the waiting units (when synchronising; otherwise they
keep waiting, their local gradients accumulating, as FSDP2's stay pending), and ends the
step as a last backward's end does. With ``async_op=True`` it only issues those
reductions and returns a handle whose ``wait()`` ends the step; a forward, or another
``finalize_backward``, before that wait is FSDP2's ``RuntimeError``.

The mode is fixed when a step's first backward starts and released when the step ends:
changing it in between (or during a backward) is FSDP2's ``RuntimeError``, as are
``finalize_backward`` without the mode, during a backward, or with HSDP sums kept by
``set_requires_all_reduce(False)``. ``finalize_backward`` before the root's first forward,
or twice with no backward between, does nothing, as under FSDP2. Never called, the waiting
units' gradients are never reduced (the next backwards add to them) and the step never
ends: call it after the step's last backward, before reading or clearing gradients.

This module holds the state and its checks; runtime/step.py does the work.
"""

from __future__ import annotations

from ..base.torch_compat import in_backward
from ..core.unit import Unit


class PendingReduction:
    """What ``finalize_backward(async_op=True)`` left for its handle's ``wait()``."""

    def __init__(self, *, ends_step: bool) -> None:
        self.ends_step = ends_step  # False: nothing was waiting (a no-op finalization)


class ManualFinalization:
    """One root's manual-finalization setting and the state of the step it governs."""

    def __init__(self) -> None:
        self.enabled = False  # set_manual_backward_finalization
        # The mode of the step in flight, fixed when its first backward starts; None
        # between steps (before the first backward, after the step's end).
        self.active: bool | None = None
        # Units whose local gradients wait for finalize_backward to reduce them, in the
        # order they began waiting (backward order).
        self.waiting: list[Unit] = []
        # An asynchronous finalization whose handle was not waited on yet.
        self.pending: PendingReduction | None = None

    def set_enabled(self, enabled: bool) -> None:
        """``set_manual_backward_finalization(enabled)``, with FSDP2's checks."""
        if enabled != self.enabled and in_backward():
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode during backward"
            )
        if self.active is not None and enabled != self.active:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode after backward starts"
            )
        self.enabled = enabled

    def begin_backward(self) -> None:
        """A backward starts: the step's mode is fixed if this is its first."""
        if self.active is None:
            self.active = self.enabled

    def wait_for(self, unit: Unit) -> None:
        """``unit``'s local gradients wait for ``finalize_backward``."""
        if unit not in self.waiting:
            self.waiting.append(unit)

    def reduced(self, unit: Unit) -> None:
        """``unit``'s local gradients were reduced (a synchronising backward reached it)."""
        if unit in self.waiting:
            self.waiting.remove(unit)

    def check_no_pending(self, what: str) -> None:
        """FSDP2's error for ``what`` (a forward, a finalization) before a handle's wait."""
        if self.pending is not None:
            raise RuntimeError(f"The previous gradient reduction must be waited on before {what}")

    def check_finalize(
        self, *, backward_running: bool, units: list[Unit], sync_grads: bool
    ) -> None:
        """``finalize_backward``'s checks, FSDP2's messages: no backward running, no unit of
        ``units`` holding an HSDP sum whose all-reduce was skipped, and, synchronising
        (``sync_grads``), no waiting HSDP unit told not to all-reduce."""
        kept_partial = _first_name(u for u in units if _keeps_partial(u))
        skipping = (u for u in self.waiting if sync_grads and _skips_all_reduce(u))
        no_all_reduce = _first_name(skipping)
        self.check_no_pending("finalizing backward again")
        if not (self.enabled if self.active is None else self.active):
            raise RuntimeError(
                "FSDP finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) before forward"
            )
        if backward_running:
            raise RuntimeError("FSDP finalize_backward must be called after backward completes")
        if kept_partial is not None:
            raise RuntimeError(
                "FSDP manual backward finalization does not support partial gradient "
                f"reductions for parameter group {kept_partial!r}. Use automatic backward "
                "finalization for this configuration"
            )
        if no_all_reduce is not None:
            raise RuntimeError(
                "FSDP manual backward finalization requires all-reduce for parameter group "
                f"{no_all_reduce!r}. Call set_requires_all_reduce(True) before finalization"
            )

    def take_waiting(self, *, sync: bool) -> list[Unit]:
        """The units to reduce now: all waiting ones when synchronising (then none wait),
        none otherwise (they keep waiting)."""
        if not sync:
            return []
        waiting, self.waiting = self.waiting, []
        return waiting

    def end_step(self) -> None:
        """The step ended: the next backward fixes the mode again."""
        self.active = None

    def reset(self) -> None:
        """``reset_iter_state``: forget the step, its waiting units and a pending handle."""
        self.active = None
        self.waiting.clear()
        self.pending = None


def _keeps_partial(unit: Unit) -> bool:
    """An HSDP unit holding a reduce-scatter sum whose all-reduce was skipped."""
    return unit.handle is not None and unit.handle.grads.replicas.kept is not None


def _skips_all_reduce(unit: Unit) -> bool:
    """An HSDP unit told not to all-reduce (``set_requires_all_reduce(False)``)."""
    handle = unit.handle
    return (
        handle is not None
        and handle.grads.replicate_comm is not None
        and not handle.grads.replicas.all_reduce_grads
    )


def _first_name(units) -> str | None:
    """The first of ``units``' names (the root's as FSDP2 names it), or None."""
    return next((unit.name or "<root>" for unit in units), None)
