"""Which units and runtimes are live: the registry of wrapped units.

A module becomes a unit once (the composition root records it here, which catches
wrapping it twice); each root's ``StepRuntime`` is recorded against its units, so that code
holding a module (``summon_full_params``, ``register_forward_method``) or a unit (the
hooks) finds the runtime. Units inside an active ``summon_full_params`` are recorded
too, so a nested summon leaves them alone. The roots themselves are recorded one layer
up, with the root object they hold (``assemble/root.py``).
Every table holds its keys weakly, and values that refer back to their keys (a unit
holds its module, a runtime its units) weakly too: a model that is dropped leaves no
entry behind and is freed with its optimizer hooks, not kept until the process ends.
"""

from __future__ import annotations

import weakref

from torch import nn

from ..core.unit import Unit
from .step import StepRuntime

# The unit each wrapped module became (kept alive by its root and by the module's hooks).
_UNITS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Unit]] = weakref.WeakKeyDictionary()
# The runtime of the root that owns each unit (kept alive by the root).
_RUNTIMES: weakref.WeakKeyDictionary[Unit, weakref.ref[StepRuntime]] = weakref.WeakKeyDictionary()
# The units an active summon selected (owning parameters or not).
_SUMMONED_UNITS: weakref.WeakSet[Unit] = weakref.WeakSet()


def add_units(runtime: StepRuntime) -> None:
    """Record that ``runtime`` owns its units (taking over units another root owned)."""
    for unit in runtime.units:
        _UNITS[unit.module] = weakref.ref(unit)
        _RUNTIMES[unit] = weakref.ref(runtime)


def managed_units() -> list[tuple[nn.Module, Unit]]:
    """Every live unit with the module it became, in wrap order."""
    pairs = [(module, ref()) for module, ref in list(_UNITS.items())]
    return [(module, unit) for module, unit in pairs if unit is not None]


def is_managed(module: nn.Module) -> bool:
    """Whether ``module`` is some root's unit already (a root itself is not)."""
    ref = _UNITS.get(module)
    return ref is not None and ref() is not None


def unit_of(module: nn.Module) -> Unit | None:
    """The unit ``module`` became, if any (a root's own unit: ``assemble.root.own_unit``)."""
    ref = _UNITS.get(module)
    return None if ref is None else ref()


def runtime_of(unit: Unit) -> StepRuntime | None:
    """The runtime of the root that owns ``unit``."""
    ref = _RUNTIMES.get(unit)
    return None if ref is None else ref()


def is_unit_summoned(unit: Unit) -> bool:
    """Whether ``unit`` is inside an active ``summon_full_params`` (an outer one counts)."""
    return unit in _SUMMONED_UNITS


def add_summoned_units(units: list[Unit]) -> list[Unit]:
    """Record ``units`` as summoned; returns those not already recorded (to discard later)."""
    added = [u for u in units if u not in _SUMMONED_UNITS]
    _SUMMONED_UNITS.update(added)
    return added


def discard_summoned_units(units: list[Unit]) -> None:
    for unit in units:
        _SUMMONED_UNITS.discard(unit)
