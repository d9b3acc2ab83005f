"""The free rule ([Note: the free rule] in shardwrap/runtime/free_rule.py), moment by moment.

The rule reads only the unit (strategy, state, forward depth, override) and two facts of
its handle (whether the gathered buffer is its own, how many bytes it holds), so a plain
record stands in for the handle. Each row is what the reshard sites in hooks.py,
runtime/step.py and runtime/schedule.py did before the rule was one function; the dist
parity tests check the numbers. Negative control, seen once: the post-backward rule with
``frees`` read as ``not frees`` fails every ``test_post_backward`` row but the one with
``reshard_after_backward`` off.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from shardwrap.core.unit import Unit
from shardwrap.options import ShardingStrategy
from shardwrap.runtime.free_rule import Moment, Release, release_rule

FLAGS = {"last_backward": True, "reshard_after_backward": True}


def make_unit(strategy: str, *, separate_full: bool = True, full_bytes: int = 0) -> Unit:
    handle = SimpleNamespace(
        separate_full=separate_full, full_storage_bytes=full_bytes, comm_quant=None
    )
    unit = Unit(
        name="u", module=nn.Linear(1, 1), handle=handle, strategy=ShardingStrategy(strategy)
    )
    unit.start_forward()
    return unit


@pytest.mark.parametrize(
    ("strategy", "facts", "release"),
    [
        ("FULL_SHARD", {}, Release.FREE),
        ("FULL_SHARD", {"kept": True}, Release.KEEP),  # the last unit of forward
        ("FULL_SHARD", {"kept": True, "training": False}, Release.FREE),
        ("SHARD_GRAD_OP", {}, Release.KEEP),
        ("SHARD_GRAD_OP", {"training": False}, Release.FREE),
        ("SHARD_OPTIM", {}, Release.SHOW_SHARD),
        ("NO_SHARD", {}, Release.KEEP),
        ("NO_SHARD", {"training": False}, Release.SHOW_SHARD),
    ],
)
def test_post_forward(strategy, facts, release) -> None:
    assert release_rule(Moment.POST_FORWARD, make_unit(strategy), **FLAGS, **facts) is release


def test_post_forward_of_a_unit_computing_on_its_mapped_shard_drops_pages() -> None:
    unit = make_unit("NO_SHARD", separate_full=False)
    assert release_rule(Moment.POST_FORWARD, unit, **FLAGS) is Release.PAGES


def test_post_forward_keeps_a_nested_forward_and_one_rerun_in_backward() -> None:
    unit = make_unit("FULL_SHARD")
    unit.enter_forward()
    assert release_rule(Moment.POST_FORWARD, unit, **FLAGS) is Release.KEEP
    unit.leave_forward()
    unit.start_backward()
    assert release_rule(Moment.POST_FORWARD, unit, **FLAGS) is Release.KEEP


@pytest.mark.parametrize(
    ("strategy", "reshard_after_backward", "release"),
    [
        ("FULL_SHARD", True, Release.FREE),
        ("FULL_SHARD", False, Release.SHOW_SHARD),
        ("SHARD_GRAD_OP", True, Release.FREE),
        ("SHARD_OPTIM", True, Release.SHOW_SHARD),
        ("NO_SHARD", True, Release.SHOW_SHARD),
    ],
)
def test_post_backward(strategy, reshard_after_backward, release) -> None:
    unit = make_unit(strategy)
    flags = {"last_backward": True, "reshard_after_backward": reshard_after_backward}
    assert release_rule(Moment.POST_BACKWARD, unit, **flags) is release


@pytest.mark.parametrize(
    ("strategy", "last", "release"),
    [
        ("FULL_SHARD", True, Release.FREE),
        ("FULL_SHARD", False, Release.SHOW_SHARD),  # mid-step: kept gathered units stay
        ("SHARD_OPTIM", True, Release.KEEP),
    ],
)
def test_abandoned(strategy, last, release) -> None:
    flags = {"last_backward": last, "reshard_after_backward": True}
    assert release_rule(Moment.ABANDONED, make_unit(strategy), **flags) is release


@pytest.mark.parametrize(
    ("strategy", "facts", "flags", "release"),
    [
        ("FULL_SHARD", {"landed": True}, FLAGS, Release.FREE),
        ("SHARD_OPTIM", {"landed": True}, FLAGS, Release.SHOW_SHARD),
        ("FULL_SHARD", {"landed": True}, {**FLAGS, "last_backward": False}, Release.SHOW_SHARD),
        ("FULL_SHARD", {}, FLAGS, Release.KEEP),  # nothing gathered
    ],
)
def test_end_of_backward(strategy, facts, flags, release) -> None:
    assert release_rule(Moment.END_OF_BACKWARD, make_unit(strategy), **flags, **facts) is release


def test_end_of_backward_frees_what_a_bucket_gathered_for_nothing() -> None:
    unit = make_unit("FULL_SHARD", full_bytes=64)
    assert release_rule(Moment.END_OF_BACKWARD, unit, **FLAGS) is Release.FREE
    kept = {**FLAGS, "reshard_after_backward": False}
    assert release_rule(Moment.END_OF_BACKWARD, unit, **kept) is Release.KEEP
    assert (
        release_rule(Moment.END_OF_BACKWARD, make_unit("SHARD_OPTIM", full_bytes=64), **FLAGS)
        is Release.KEEP
    )


@pytest.mark.parametrize(
    ("moment", "facts"),
    [
        (Moment.POST_FORWARD, {}),
        (Moment.POST_BACKWARD, {}),
        (Moment.USER_CALL, {}),
        (Moment.END_OF_BACKWARD, {"landed": True}),
    ],
)
def test_a_unit_keeping_its_storage_shows_its_shard_where_it_would_free(moment, facts) -> None:
    """FSDP2's ``set_keep_unsharded_storage(True)``: the same moments release, the buffer
    stays (the FREE row first, so the test is not vacuous)."""
    unit = make_unit("FULL_SHARD", full_bytes=4)
    assert release_rule(moment, unit, **FLAGS, **facts) is Release.FREE
    unit.set_keeps_full_storage(True)
    assert release_rule(moment, unit, **FLAGS, **facts) is Release.KEEP_STORAGE
