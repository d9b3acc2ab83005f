"""FSDP1's ``training_state``, read off the step: idle, in forward or backward, or summoned.

FSDP1 keeps a ``training_state`` on every instance (``IDLE``, ``FORWARD_BACKWARD``,
``SUMMON_FULL_PARAMS``) and checks it with ``_assert_state``: ``apply()`` refuses to run
outside ``IDLE`` (here too), and torch's own test utilities assert ``IDLE`` after each
training loop. shardwrap keeps no such field: the unit's forward depth,
the step's backward and the summon registry already say where it stands, so the state is
computed from them (one owner each, nothing to keep in step). As FSDP1: a unit is in
``FORWARD_BACKWARD`` while its forward runs and from the backward reaching it until the
backward's end; a root while any forward of its model runs or its backward is in flight;
``IDLE`` between a forward and its backward.
"""

from __future__ import annotations

from enum import Enum

from ..base.torch_compat import fsdp1_training_states
from ..core.unit import TrainingState, Unit
from . import registry


def unit_training_state(unit: Unit) -> Enum:
    """FSDP1's ``training_state`` of the unit module ``unit`` became."""
    states = fsdp1_training_states()
    if registry.is_unit_summoned(unit):
        return states.SUMMON_FULL_PARAMS
    runtime = registry.runtime_of(unit)
    in_backward = runtime is not None and runtime.backward_in_flight
    if unit.forward_depth > 0 or (
        in_backward and unit.state in (TrainingState.BACKWARD, TrainingState.BACKWARD_DONE)
    ):
        return states.FORWARD_BACKWARD
    return states.IDLE


def root_training_state(own_unit: Unit, units: list[Unit]) -> Enum:
    """FSDP1's ``training_state`` of a root: ``SUMMON_FULL_PARAMS`` while its own unit is
    summoned, else ``FORWARD_BACKWARD`` while any unit's forward runs or the root's
    backward is in flight."""
    states = fsdp1_training_states()
    if registry.is_unit_summoned(own_unit):
        return states.SUMMON_FULL_PARAMS
    # Covers the own unit's forward and backward (unit_training_state's) too.
    runtime = registry.runtime_of(own_unit)
    if (runtime is not None and runtime.backward_in_flight) or any(
        u.forward_depth > 0 for u in units
    ):
        return states.FORWARD_BACKWARD
    return states.IDLE


def assert_training_state(current: Enum, expected: Enum | list[Enum]) -> None:
    """FSDP1's ``_assert_state``: raise ``ValueError`` unless ``current`` is ``expected``
    (a state or a list of them)."""
    allowed = expected if isinstance(expected, list) else [expected]
    if current not in allowed:
        raise ValueError(f"expected to be in states {allowed} but current state is {current}")
