"""What the FSDP2 door knows about each module ``fully_shard`` was called on.

One record per call, kept against the module weakly (as FSDP2 keeps its state against
the module): the unit the call made, the mesh, the call's ``reshard_after_forward``, and,
for the module whose call is a root now (the outermost so far), that ``ShardRoot`` (kept
alive here: ``assemble/root.py``'s registry holds it weakly) and its forward hook. A later
call on an ancestor adopts the units and clears those.
"""

from __future__ import annotations

import weakref
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


_STATE: weakref.WeakKeyDictionary[nn.Module, DoorUnit] = weakref.WeakKeyDictionary()


def state_of(module: nn.Module) -> DoorUnit | None:
    """The record of ``fully_shard(module)``, or None if it was not called on it."""
    return _STATE.get(module)


def set_state(module: nn.Module, state: DoorUnit) -> None:
    _STATE[module] = state


def runtime_for(module: nn.Module) -> StepRuntime:
    """The runtime of the root that owns ``module``'s unit."""
    state = _STATE.get(module)
    if state is None:
        raise RuntimeError(f"{type(module).__name__}: fully_shard was not called on it")
    runtime = registry.runtime_of(state.unit)
    if runtime is None:
        raise RuntimeError(f"unit {state.unit.name!r} is not attached to a root")
    return runtime
