"""``ShardRoot``: one wrapped model as every door builds it, and the registry of roots.

The root holds what wrapping made: the units, the step runtime, the communicators and
their ledger, the disk store, the ZeRO++ settings, and the options it was built from.
``build.compose.build_root`` makes it; a door keeps it on the object its users hold (the
``ShardedModule``) and records it here, so that code holding only that object
(checkpoints, the profiler, the DeepSpeed engines) finds it with :func:`root_of`, typed,
instead of reaching into the door's attributes or guessing from ``hasattr``.
The registry holds its keys and roots weakly: the holder keeps its root alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..comm.collectives import CommLedger, Communicator
from ..core.unit import Unit
from ..offload.disk import DiskStore
from ..options import CommQuantization
from ..runtime import registry
from ..runtime.step import StepRuntime
from .comms import RootComms
from .wrap_options import WrapOptions


@dataclass(frozen=True, eq=False)
class ShardRoot:
    """Everything one wrapped model is made of, built once by ``build_root``."""

    module: nn.Module  # the model; its own unit is ``units[0]``
    options: WrapOptions
    units: list[Unit]  # wrap order: the new units, root's first, then adopted nested ones
    runtime: StepRuntime
    comms: RootComms
    comm_ledger: CommLedger  # every communicator of the root records into it
    disk_store: DiskStore | None  # DiskOffload's mapped files; None without DiskOffload
    comm_quantization: CommQuantization | None  # as given (possibly all switches off)
    # ``runtime.begin_forward`` run eagerly under torch.compile ([Note: hooks outside the
    # compiled graph] in base/compiler.py): a door calls it before each forward.
    begin_forward: Callable[[], None]

    def communicators(self) -> list[Communicator]:
        """The world communicator and every unit's shard and replicate communicators."""
        comms = [self.runtime.world_comm]
        for unit in self.units:
            if unit.handle is not None:
                comms.append(unit.handle.shard_comm)
                if unit.handle.replicate_comm is not None:
                    comms.append(unit.handle.replicate_comm)
        return comms


# The object users hold (a ``ShardedModule``) -> the root it was built into.
_ROOTS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ShardRoot]] = weakref.WeakKeyDictionary()


def add_root(holder: nn.Module, root: ShardRoot) -> None:
    """Record ``holder`` as the object users hold for ``root``, and the root's units."""
    _ROOTS[holder] = weakref.ref(root)
    registry.add_units(root.runtime)


def forget_root(holder: nn.Module) -> None:
    """``holder`` is no root any more: an enclosing root adopted its units, and the holder
    stays in the tree (the FSDP2 door's module; a ``ShardedModule`` leaves the tree)."""
    _ROOTS.pop(holder, None)


def find_root(module: nn.Module) -> ShardRoot | None:
    """The root ``module`` holds, or ``None`` when it is no root (a unit module is not)."""
    ref = _ROOTS.get(module)
    return None if ref is None else ref()


def is_root(module: nn.Module) -> bool:
    """Whether ``module`` is a root (a ``ShardedModule``); unit modules, which also answer
    ``isinstance(m, ShardedModule)``, are not."""
    return find_root(module) is not None


def root_of(model: object, argument: str = "model") -> ShardRoot:
    """The root ``model`` holds; ``TypeError`` naming ``argument`` when it holds none."""
    root = find_root(model) if isinstance(model, nn.Module) else None
    if root is None:
        raise TypeError(f"{argument}: expected a ShardedModule, got {type(model).__name__}")
    return root


def holders_in(module: nn.Module) -> list[nn.Module]:
    """The roots' holders in ``module``'s tree (itself included), in module order."""
    return [m for m in module.modules() if is_root(m)]


def own_unit(module: nn.Module) -> Unit | None:
    """The unit ``module`` became, or for a root, its own module's unit."""
    root = find_root(module)
    return registry.unit_of(root.module if root is not None else module)


class RootField:
    """A door's attribute read from the root its object holds (the value's one owner): a
    field of the root, or of its options (``options=True``), of the same name."""

    def __init__(self, *, options: bool = False) -> None:
        self.options = options
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, holder: nn.Module | None, owner: type | None = None) -> Any:
        if holder is None:
            return self
        root = find_root(holder)
        if root is None:  # an AttributeError, so that hasattr and getattr's default hold
            raise AttributeError(f"{self.name}: {type(holder).__name__} holds no root yet")
        return getattr(root.options if self.options else root, self.name)
