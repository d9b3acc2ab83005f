"""One unit: a wrapped module, its flat parameter handle, and where it is in a step.

The step runtime (``runtime/step.py``) decides when a unit moves; the unit changes its own
fields, through the methods below, and checks that each move is one its state machine has.
"""

from __future__ import annotations

import enum
from typing import Any

from torch import nn

from ..flat_param import FlatParamHandle
from ..options import ShardingStrategy
from .comm_quant import GatherPhase


class TrainingState(enum.Enum):
    IDLE = "IDLE"  # no step in flight; shards only
    FORWARD = "FORWARD"  # ran forward this step; its gradients may still come
    BACKWARD = "BACKWARD"  # gathered again for backward; local gradients accumulating
    BACKWARD_DONE = "BACKWARD_DONE"  # gradients reduced (or kept, under no_sync); resharded


_PHASES = {TrainingState.IDLE: GatherPhase.FORWARD, TrainingState.FORWARD: GatherPhase.BACKWARD}


class Unit:
    """One wrapped module and its flat parameter handle (``None`` when it owns none)."""

    def __init__(
        self,
        *,
        name: str,
        module: nn.Module,
        handle: FlatParamHandle | None,
        strategy: ShardingStrategy,
    ) -> None:
        self.name = name
        self.module = module
        self.handle = handle
        self.strategy = strategy
        # Every field below is written only by this class's methods.
        self.state = TrainingState.IDLE
        # Forwards of this unit in progress: a registered method (``generate``) that calls
        # ``forward`` nests them; only the outermost one reshards.
        self.forward_depth = 0
        # None: the strategy decides; True/False: set_reshard_after_forward overrides it.
        self.reshard_after_forward_override: bool | None = None
        # Whether backward may reach (and gather) the unit this step: False only after a
        # forward with grad enabled none of whose outputs needs a gradient. Only such
        # units are prefetched for backward.
        self.expects_backward = False
        self.hook_handles: list[Any] = []  # its module's forward hooks (see hooks.register)
        # FSDP2's explicit prefetch: the units to gather ahead once this one is gathered for
        # forward / for backward, in order; None: the schedule chooses ([Note: explicit
        # prefetch] in runtime/schedule.py).
        self.forward_prefetch_targets: tuple[Unit, ...] | None = None
        self.backward_prefetch_targets: tuple[Unit, ...] | None = None
        # False: backward never gathers the unit (FSDP2's set_unshard_in_backward(False):
        # its parameters' values are not needed there, e.g. an embedding's), nor prefetches
        # it; its gradients are still reduced ([Note: units not gathered for backward]).
        self.unshard_in_backward = True
        # True (the FSDP2 door): a forward without grad releases the unit by its
        # reshard_after_forward, as one with grad does; False: it frees ([Note: a forward
        # without grad on the FSDP2 door] in runtime/free_rule.py).
        self.no_grad_follows_reshard_setting = False
        # True: where the unit would free its gathered buffer it keeps the storage, its
        # values stale (FSDP2's set_keep_unsharded_storage: the full views keep their
        # storage and data pointers; every unshard still gathers).
        self.keeps_full_storage = False

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {self.state.name})"

    @property
    def reshard_after_forward(self) -> bool:
        """Free the gathered parameters after forward (re-gather them for backward)."""
        if self.reshard_after_forward_override is not None:
            return self.reshard_after_forward_override and self.strategy.free_after_backward
        return self.strategy.reshard_after_forward

    # ------------------------------------------------------------ its own fields
    def set_reshard_after_forward(self, reshard: bool) -> None:
        """Override the strategy's reshard after forward (``set_reshard_after_forward``)."""
        self.reshard_after_forward_override = reshard

    def set_prefetch_targets(self, *, forward: bool, targets: tuple[Unit, ...]) -> None:
        """Gather ``targets`` ahead once this unit is gathered for forward (``forward``)
        or for backward (``set_modules_to_forward/backward_prefetch``)."""
        if forward:
            self.forward_prefetch_targets = targets
        else:
            self.backward_prefetch_targets = targets

    def follow_reshard_setting_without_grad(self) -> None:
        """Release after a forward without grad as after one with grad (FSDP2's rule)."""
        self.no_grad_follows_reshard_setting = True

    def set_unshard_in_backward(self, unshard: bool) -> None:
        """Whether backward gathers the unit (``set_unshard_in_backward``)."""
        self.unshard_in_backward = unshard

    def set_keeps_full_storage(self, keep: bool) -> None:
        """Whether a release keeps the gathered buffer (``set_keep_unsharded_storage``)."""
        self.keeps_full_storage = keep

    def enter_forward(self) -> None:
        """A forward of this unit starts (possibly inside another one of its own)."""
        self.forward_depth += 1

    def leave_forward(self) -> bool:
        """A forward of this unit ends; whether it was the outermost one."""
        self.forward_depth = max(self.forward_depth - 1, 0)
        return self.forward_depth == 0

    def clear_forward_depth(self) -> None:
        """A new root forward: a forward that raised never ran its post-forward."""
        self.forward_depth = 0

    def rename(self, prefix: str) -> None:
        """Prefix the unit's name and its parameters' (an enclosing root adopted it)."""
        self.name = f"{prefix}.{self.name}" if self.name else prefix
        if self.handle is not None:
            self.handle.rename(prefix)

    def add_hook_handle(self, handle: Any) -> None:
        """Keep one of its module's forward hooks, for :meth:`remove`."""
        self.hook_handles.append(handle)

    def set_expects_backward(self, expects: bool) -> None:
        """Whether backward may reach (and gather) the unit this step."""
        self.expects_backward = expects

    # ------------------------------------------------------------ transitions
    # Each moves the unit from the states listed to the next one, and raises (naming the
    # unit and both states) from any other: the hooks and the runtime decide when a step
    # moves a unit, these check that the move is one the state machine has.
    def start_forward(self) -> None:
        """First forward of a step (or a further backward through a retained graph)."""
        self._move(TrainingState.FORWARD, TrainingState.IDLE)

    def start_backward(self) -> None:
        """Backward reached the unit: it is gathered again and accumulates gradients."""
        self._move(TrainingState.BACKWARD, TrainingState.FORWARD, TrainingState.BACKWARD_DONE)

    def finish_backward(self) -> None:
        """Its gradients are reduced (or kept, under ``no_sync``) and it is resharded."""
        self._move(TrainingState.BACKWARD_DONE, TrainingState.FORWARD, TrainingState.BACKWARD)

    def end_step(self) -> None:
        """The step is over (backward finished, or a forward was abandoned): from any state."""
        self.state = TrainingState.IDLE
        self._note_phase()

    def _move(self, to: TrainingState, *allowed: TrainingState) -> None:
        if self.state not in allowed:
            names = ", ".join(s.name for s in allowed)
            raise RuntimeError(
                f"unit {self.name!r}: cannot move to {to.name} from {self.state.name} "
                f"(only from {names})"
            )
        self.state = to
        self._note_phase()

    def _note_phase(self) -> None:
        """Tell a ZeRO++ handle what its next gather is for ([Note: ZeRO++ in a unit])."""
        if self.handle is not None and self.handle.comm_quant is not None:
            self.handle.comm_quant.note_phase(_PHASES.get(self.state, GatherPhase.AFTER))

    def remove(self) -> None:
        """Remove this unit's forward hooks from its module."""
        for h in self.hook_handles:
            h.remove()
        self.hook_handles.clear()
