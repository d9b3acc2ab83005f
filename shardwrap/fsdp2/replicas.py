"""HSDP's knobs on the FSDP2 door: skipping the replica all-reduce, and the all-reduce hook.

The engine side is ``core/replica_grads.py`` ([Note: the replica all-reduce skipped],
[Note: the all-reduce hook]); here each ``FSDPModule`` method's arguments are checked and set on the
units they name, as FSDP2 sets them on its parameter groups: ``set_requires_all_reduce``
on the module's unit and, with ``recurse``, every unit below; the hook on the module's
own unit only. On a 1-D mesh there is no all-reduce to skip, and the flag changes
nothing, as under FSDP2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..core.grads import UnitGrads
from .state import state_of


def _unit_grads(modules: Iterable[nn.Module]) -> list[UnitGrads]:
    """The gradients of the units ``fully_shard`` made for ``modules`` (once each)."""
    found: dict[int, UnitGrads] = {}
    for module in modules:
        state = state_of(module)
        handle = state.unit.handle if state is not None else None
        if handle is not None:  # a unit without parameters reduces nothing
            found[id(handle.grads)] = handle.grads
    return list(found.values())


def set_all_reduce(modules: Iterable[nn.Module], requires_all_reduce: bool) -> None:
    """Whether the units of ``modules`` all-reduce their gradients across replicas."""
    grads = _unit_grads(modules)
    if not requires_all_reduce:
        for unit_grads in grads:
            if unit_grads.reduces_in_place:
                raise NotImplementedError(
                    "FSDPModule.set_requires_all_reduce(False) is not yet supported by "
                    f"shardwrap for unit {unit_grads.comm_label!r}: its mesh's shard dimension "
                    "has size 1, so its gradient is only all-reduced (in place, no "
                    "reduce-scatter output to keep); use set_requires_gradient_sync(False)"
                )
    for unit_grads in grads:
        unit_grads.replicas.require_all_reduce(requires_all_reduce)


def set_hook(
    module: nn.Module, hook: Callable[[torch.Tensor], None], stream: object, *, hsdp: bool
) -> None:
    """``module``'s unit calls ``hook`` on its final reduced chunk ([Note: the all-reduce
    hook] in ``core/replica_grads.py``)."""
    if not callable(hook):
        raise TypeError(f"hook: expected a callable, got {hook!r}")
    if stream is not None:
        if hsdp:  # FSDP2's own error
            raise ValueError("stream: cannot be set when using native HSDP (a 2-D mesh)")
        raise NotImplementedError(
            "FSDPModule.set_all_reduce_hook(stream=...) is not yet supported by shardwrap: "
            "the hook runs on the current stream, after the unit's reduce-scatter; pass "
            "stream=None"
        )
    for unit_grads in _unit_grads([module]):
        if unit_grads.reduce_dtype != unit_grads.dtype:
            raise NotImplementedError(
                "FSDPModule.set_all_reduce_hook is not yet supported by shardwrap for unit "
                f"{unit_grads.comm_label!r}: its mp_policy reduces in {unit_grads.reduce_dtype}"
                f" and its parameters are {unit_grads.dtype}; FSDP2 calls the hook on the "
                "reduce-dtype output, shardwrap divides after the cast. Reduce in the "
                "parameters' dtype (mp_policy reduce_dtype)"
            )
        if unit_grads.divides_around_reduction:
            raise NotImplementedError(
                "FSDPModule.set_all_reduce_hook is not yet supported by shardwrap for unit "
                f"{unit_grads.comm_label!r}: it reduces in float16, where FSDP2 calls the "
                "hook between its division before the sum and the one after it, and "
                "shardwrap divides both before the hook. Reduce in float32 or bfloat16 "
                "(mp_policy reduce_dtype)"
            )
        unit_grads.replicas.hook = hook


def set_force_sum(module: nn.Module, enable: bool) -> None:
    """``set_force_sum_reduction_for_comms``: whether ``module``'s hook sees the sum (the
    division after it), as FSDP2's does when its collectives only sum."""
    for unit_grads in _unit_grads([module]):
        unit_grads.replicas.hook_sees_sum = enable
