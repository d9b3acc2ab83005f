"""What the FSDP2 door knows about each module ``fully_shard`` was called on.

One record per call, kept on the module itself (an attribute), as FSDP2's state lives
with the module: the record reaches the module (its unit, its root), so a weak map keyed
by the module never let either go, and every model given to ``fully_shard`` lived until
the process ended. The record holds the unit the call made, the mesh, the call's
``reshard_after_forward``, and, for the module whose call is a root now (the outermost so
far), that ``ShardRoot`` (kept alive here: ``assemble/root.py``'s registry holds it
weakly) and its forward hook. A later call on an ancestor adopts the units and clears
those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..assemble.root import ShardRoot
from ..core.unit import Unit
from ..runtime import registry
from ..runtime.step import StepRuntime


@dataclass(eq=False)
class DoorUnit:
    """One ``fully_shard`` call's unit (see the module docstring)."""

    unit: Unit
    mesh: DeviceMesh
    # As given (set_reshard_after_forward changes it); None: False for the root, else True.
    reshard_after_forward: bool | None
    members: tuple[nn.Module, ...]  # the modules of the call (several: a list as one unit)
    root: ShardRoot | None = None  # set while this call's module is a root
    root_hook: Any = None  # the root's forward pre-hook handle (begin_forward)
    group: Any = None  # a list unit's group_hooks.GroupPass (None: a single module)


_ATTRIBUTE = "_shardwrap_fully_shard"  # in the module's __dict__: no nn.Module lookup


def state_of(module: nn.Module) -> DoorUnit | None:
    """The record of ``fully_shard(module)``, or None if it was not called on it."""
    return module.__dict__.get(_ATTRIBUTE)


def set_state(module: nn.Module, state: DoorUnit) -> None:
    module.__dict__[_ATTRIBUTE] = state


def unit_of(module: nn.Module) -> Unit:
    """The unit ``fully_shard(module)`` made; ``RuntimeError`` if it was not called on it."""
    state = state_of(module)
    if state is None:
        raise RuntimeError(f"{type(module).__name__}: fully_shard was not called on it")
    return state.unit


def runtime_for(module: nn.Module) -> StepRuntime:
    """The runtime of the root that owns ``module``'s unit."""
    unit = unit_of(module)
    runtime = registry.runtime_of(unit)
    if runtime is None:
        raise RuntimeError(f"unit {unit.name!r} is not attached to a root")
    return runtime
