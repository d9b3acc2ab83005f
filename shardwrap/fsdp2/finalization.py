"""FSDP2's manual backward finalization and ``set_keep_unsharded_storage`` on the door
(torch 2.15's ``FSDPModule`` methods, offered on every release): the methods' bodies, on
the root's step runtime ([Note: manual backward finalization] in
runtime/manual_finalization.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..base.validate import check_bool
from ..runtime.manual_finalization import PendingReduction
from .state import runtime_for, state_of


class GradientReductionHandle:
    """What ``finalize_backward(async_op=True)`` returns: ``wait()`` waits for the
    reductions it issued, assigns the gradients and ends the step."""

    def __init__(self, module: nn.Module | None, pending: PendingReduction | None) -> None:
        self._module = module  # None: nothing to wait for (before the first forward)
        self._pending = pending

    def wait(self) -> None:
        """Wait for the gradient reduction and end the step (once; later calls do nothing).
        Raises ``RuntimeError`` after ``reset_iter_state`` invalidated it, as FSDP2's."""
        module, pending = self._module, self._pending
        if module is not None and pending is not None:
            runtime_for(module).finish_finalize(pending)
            self._module = self._pending = None


def set_manual(module: nn.Module, enabled: object) -> None:
    """``FSDPModule.set_manual_backward_finalization`` on ``module`` (the root)."""
    value = check_bool("enabled", enabled)
    _root_runtime(module, "set_manual_backward_finalization").manual.set_enabled(value)


def finalize(module: nn.Module, async_op: object) -> GradientReductionHandle | None:
    """``FSDPModule.finalize_backward`` on ``module`` (the root)."""
    wait = not check_bool("async_op", async_op)
    runtime = runtime_for(module)
    if not runtime.has_run_forward:  # FSDP2: a no-op before the first forward
        return None if wait else GradientReductionHandle(None, None)
    runtime.manual.check_no_pending("finalizing backward again")
    pending = _root_runtime(module, "finalize_backward").start_finalize()
    if wait:
        runtime.finish_finalize(pending)
        return None
    return GradientReductionHandle(module, pending)


def keep_storage(module: nn.Module, keep: object, recurse: object) -> None:
    """``FSDPModule.set_keep_unsharded_storage`` on ``module`` (and, with ``recurse``,
    every unit below)."""
    value = check_bool("keep", keep)
    modules = module.modules() if check_bool("recurse", recurse) else [module]
    for sub in modules:
        state = state_of(sub)
        if state is not None:
            state.unit.set_keeps_full_storage(value)


def _root_runtime(module: Any, method: str):
    """The runtime of ``module``, which must be the root (FSDP2's error otherwise)."""
    state = state_of(module)
    if state is not None and state.root is None:
        raise RuntimeError(f"{method} must be called on the root FSDP module")
    return runtime_for(module)
