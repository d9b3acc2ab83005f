"""Which units and runtimes are live: the one registry of wrapped state.

A module becomes a unit once (``ShardedModule`` records it here, which catches wrapping it
twice); each root's ``StepRuntime`` is recorded against its units, so that code holding a
module (``summon_full_params``, ``register_forward_method``) or only an optimizer (a grad
scaler) finds the runtime without reaching into ``ShardedModule``. Handles inside an
active ``summon_full_params`` are recorded too, so a nested summon leaves them alone.
Every table holds its keys weakly, and values that refer back to their keys (a unit
holds its module, a runtime its units) weakly too: a model that is dropped leaves no
entry behind and is freed with its optimizer hooks, not kept until the process ends.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from ..core.unit import Unit
from ..flat_param import FlatParamHandle

# A root's ``runtime.step.StepRuntime``; typed loosely here because the runtime imports this
# module (registering itself), and the import may only go one way.
StepRuntime = Any

# The unit each wrapped module became (kept alive by its root and by the module's hooks).
_UNITS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Unit]] = weakref.WeakKeyDictionary()
# The runtime of the root that owns each unit (kept alive by the root).
_RUNTIMES: weakref.WeakKeyDictionary[Unit, weakref.ref] = weakref.WeakKeyDictionary()
# Roots (``ShardedModule``) and the module each wraps.
_ROOTS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
# Runtimes whose optimizer hooks are live (ZeRO-1 units; see ``reduce_deferred_grads_for``).
_STEPPING: weakref.WeakSet[StepRuntime] = weakref.WeakSet()
# Handles inside an active summon.
_SUMMONED: weakref.WeakSet[FlatParamHandle] = weakref.WeakSet()


def add_root(root: nn.Module, inner: nn.Module, runtime: StepRuntime) -> None:
    """Record a root wrapping ``inner``, and that ``runtime`` owns its units."""
    _ROOTS[root] = inner
    for unit in runtime.units:
        _UNITS[unit.module] = weakref.ref(unit)
        _RUNTIMES[unit] = weakref.ref(runtime)


def remove_root(root: nn.Module) -> None:
    """Forget ``root`` as a root: an enclosing root adopted its units (the FSDP2 door,
    where a nested call's module stays in the tree)."""
    _ROOTS.pop(root, None)


def managed_units() -> list[tuple[nn.Module, Unit]]:
    """Every live unit with the module it became, in wrap order."""
    pairs = [(module, ref()) for module, ref in list(_UNITS.items())]
    return [(module, unit) for module, unit in pairs if unit is not None]


def is_managed(module: nn.Module) -> bool:
    """Whether ``module`` is some root's unit already (a root itself is not)."""
    ref = _UNITS.get(module)
    return ref is not None and ref() is not None


def unit_of(module: nn.Module) -> Unit | None:
    """The unit ``module`` (or, for a root, the module it wraps) became, if any."""
    ref = _UNITS.get(_ROOTS.get(module, module))
    return None if ref is None else ref()


def wrapped_module(module: nn.Module) -> nn.Module | None:
    """The module a root wraps; ``None`` when ``module`` is no root."""
    return _ROOTS.get(module)


def is_root(module: nn.Module) -> bool:
    """Whether ``module`` is a root (a ``ShardedModule``); unit modules, which also answer
    ``isinstance(m, ShardedModule)``, are not."""
    return module in _ROOTS


def runtime_of(unit: Unit) -> StepRuntime | None:
    """The runtime of the root that owns ``unit``."""
    ref = _RUNTIMES.get(unit)
    return None if ref is None else ref()


def add_stepping(runtime: StepRuntime) -> None:
    _STEPPING.add(runtime)


def discard_stepping(runtime: StepRuntime) -> None:
    _STEPPING.discard(runtime)


def stepping_runtimes() -> list[StepRuntime]:
    """Runtimes whose ZeRO-1 optimizer hooks are live."""
    return list(_STEPPING)


def is_summoned(handle: FlatParamHandle) -> bool:
    return handle in _SUMMONED


def add_summoned(handle: FlatParamHandle) -> None:
    _SUMMONED.add(handle)


def discard_summoned(handle: FlatParamHandle) -> None:
    _SUMMONED.discard(handle)
