"""A unit's training-state machine: the moves it has, and the error for any other."""

from __future__ import annotations

import pytest
from torch import nn

from shardwrap.core.unit import TrainingState, Unit
from shardwrap.options import ShardingStrategy


def make_unit() -> Unit:
    return Unit(
        name="block", module=nn.Linear(2, 2), handle=None, strategy=ShardingStrategy.FULL_SHARD
    )


def test_a_step_moves_through_every_state() -> None:
    unit = make_unit()
    unit.start_forward()
    assert unit.state is TrainingState.FORWARD
    unit.start_backward()
    assert unit.state is TrainingState.BACKWARD
    unit.finish_backward()
    assert unit.state is TrainingState.BACKWARD_DONE
    unit.start_backward()  # a further backward through a retained graph
    unit.finish_backward()
    unit.end_step()
    assert unit.state is TrainingState.IDLE


def test_a_frozen_unit_finishes_backward_from_forward() -> None:
    unit = make_unit()
    unit.start_forward()
    unit.finish_backward()  # the end-of-backward callback reduces units backward missed
    assert unit.state is TrainingState.BACKWARD_DONE


@pytest.mark.parametrize(
    ("moves", "message"),
    [
        (["start_backward"], "'block': cannot move to BACKWARD from IDLE"),
        (["finish_backward"], "'block': cannot move to BACKWARD_DONE from IDLE"),
        (["start_forward", "start_forward"], "cannot move to FORWARD from FORWARD"),
        (["start_forward", "finish_backward", "finish_backward"], "from BACKWARD_DONE"),
    ],
)
def test_other_moves_raise_naming_the_unit_and_both_states(moves, message) -> None:
    unit = make_unit()
    for move in moves[:-1]:
        getattr(unit, move)()
    with pytest.raises(RuntimeError, match=message):
        getattr(unit, moves[-1])()


def test_only_the_outermost_forward_leaves() -> None:
    # A registered method (``generate``) that calls ``forward`` nests the unit's forwards;
    # only the outermost one may reshard. Control: a leave_forward that always answers
    # True fails the first assertion.
    unit = make_unit()
    unit.enter_forward()
    unit.enter_forward()
    assert not unit.leave_forward()
    assert unit.leave_forward()
    assert unit.leave_forward()  # a forward that raised left no depth below zero
    assert unit.forward_depth == 0
