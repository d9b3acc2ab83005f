"""Asynchronous saves: the checkpoint holds the state at the call, however training goes
on; staging buffers are reused; a second save waits for the first; failures and killed
ranks are reported and leave the previous checkpoint loadable."""

from __future__ import annotations

import os

import pytest

from shardwrap.ckpt.format import read_index
from tests.dist import engine_cases
from tests.dist.async_ckpt_workers import (
    GATE_SECONDS,
    async_crash_phase,
    collectives_of_a_save_call,
    failing_background_write,
    matches_snapshot,
    matches_snapshots,
    saved_model_is_collected,
    saves_across_layout_changes,
    train_while_saving,
)
from tests.dist.ckpt_workers import assemble, load_outcomes, phase
from tests.dist.harness import run_ranks


def _saved_and_loaded(tmp_path, alias: bool) -> tuple[list[dict], list[bool]]:
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    observed = run_ranks(train_while_saving, 2, "FULL_SHARD", first, second, alias)
    matches = []
    for path, which in ((first, 0), (second, 1)):
        snapshot = assemble([o["pieces"][which] for o in observed])
        matches.append(all(run_ranks(matches_snapshot, 2, "SHARD_GRAD_OP", path, snapshot)))
    return observed, matches


def test_async_save_holds_the_state_at_the_call(tmp_path):
    observed, matches = _saved_and_loaded(tmp_path, alias=False)
    # Training went on (two steps) while the first save was still running, and it still
    # loads as the state at the call; the second save holds the state at its own call.
    assert all(o["running"] for o in observed), observed
    assert matches == [True, True]
    # The second save waited for the first (held back GATE_SECONDS) before staging.
    assert all(o["first_done_when_second_returned"] for o in observed), observed
    assert all(o["waited"] >= GATE_SECONDS for o in observed), observed
    # Staged into the same host buffers both times: no allocation after the first save.
    assert all(o["same_buffers"] for o in observed), observed


def test_staging_that_aliases_live_tensors_is_caught(tmp_path):
    """Negative control: handing the writer the live tensors instead of copies makes the
    first checkpoint hold the state after the steps that followed the call."""
    _, matches = _saved_and_loaded(tmp_path, alias=True)
    assert matches == [False, True]


def _layout_changes(tmp_path, stale: bool) -> tuple[list[dict], list[bool]]:
    observed = run_ranks(saves_across_layout_changes, 2, str(tmp_path), stale, not stale)
    paths = [str(tmp_path / name) for name in "abcd"]
    snapshots = [assemble([o["pieces"][index] for o in observed]) for index in range(4)]
    every_rank = run_ranks(matches_snapshots, 2, "SHARD_GRAD_OP", paths, snapshots)
    return observed, [all(found) for found in zip(*every_rank, strict=True)]


def test_staging_plan_is_rebuilt_when_the_layout_changes(tmp_path):
    """The saver's plan ([Note: staging plans]) is kept while the layout holds and rebuilt
    when it changes: optimizer state that appears after the first save, new state tensors
    after a resume; each checkpoint loads as the state at its call, settings included.

    Negative controls: the next test (a stale plan); and, run once, the key of
    ``observe`` without the groups' boundaries (the parameters in one tuple): ``e`` reused
    the plan of ``d`` and its ``result()`` failed pairing three groups with two."""
    observed, matches = _layout_changes(tmp_path, stale=False)
    assert matches == [True, True, True, True]
    for o in observed:
        # a; b: state appeared; c: new state tensors; d: unchanged, the plan kept;
        # e: the last group split in two, the parameters in the same order.
        assert o["plans"] == [1, 2, 3, 3, 4], o["plans"]
        # The arena grew once (for the optimizer state), then was reused.
        assert o["arenas"][1] == o["arenas"][2] == o["arenas"][3] == o["arenas"][4], o["arenas"]
    lrs = [read_index(str(tmp_path / name)).param_groups[0]["lr"] for name in "abcde"]
    assert lrs == observed[0]["lr"] and lrs[2] == lrs[1] / 2, lrs
    groups = read_index(str(tmp_path / "e")).param_groups
    before = [g["params"] for g in read_index(str(tmp_path / "d")).param_groups]
    assert [g["params"] for g in groups] == [*before[:-1], before[-1][:-2], before[-1][-2:]]
    assert groups[-1]["lr"] == groups[-2]["lr"] / 4, groups


def test_stale_staging_plan_loses_the_optimizer_state(tmp_path):
    """Negative control of the test above (without ``e``): a plan kept whatever changed
    (``fits`` always true) saves ``b`` with the optimizer state of ``a``'s layout, none, so
    ``b`` loads without its two steps' Adam state; resuming from it cleared the state, so
    ``c`` and ``d`` hold none either and still match."""
    observed, matches = _layout_changes(tmp_path, stale=True)
    assert matches == [True, False, True, True]
    assert all(o["plans"] == [1, 1, 1, 1] for o in observed), observed


def test_background_write_failure_names_rank_and_file(tmp_path):
    path = str(tmp_path / "ckpt")
    reports = run_ranks(failing_background_write, 2, path)
    for error, _, _ in reports:  # every rank's result() raises the same error
        # (rank 0 relays what each rank reported, as a synchronous save's error does)
        assert "rank 1: OSError: [Errno 28] writing checkpoint file" in error, error
        assert "-rank00001.safetensors" in error and "No space left" in error, error
    index_before = reports[0][1]
    assert open(os.path.join(path, "index.json"), "rb").read() == index_before
    # The committed save still loads whole, as it was; the failed one left no file.
    snapshot = assemble([pieces for _, _, pieces in reports])
    assert run_ranks(load_outcomes, 2, "NO_SHARD", [path], snapshot) == [["ok"], ["ok"]]
    assert not [n for n in os.listdir(path) if n.endswith(".tmp")]


def test_killed_rank_during_background_write_leaves_previous_checkpoint(tmp_path):
    """tests/dist/test_checkpoint_crash.py's kill, on the asynchronous path, over the
    previous checkpoint's own folder (the new-folder case differs only before the write)."""
    previous = str(tmp_path / "step2")
    snapshot = assemble(run_ranks(phase, 2, "FULL_SHARD", None, previous, None, 0))
    index_before = open(os.path.join(previous, "index.json"), "rb").read()
    with pytest.raises(AssertionError) as failure:
        run_ranks(async_crash_phase, 2, previous, previous, snapshot, fresh=True)  # kills rank 1
    # Rank 0 learns of the death from the save's handle.
    assert "asynchronous save of checkpoint" in str(failure.value), str(failure.value)[-2000:]
    assert open(os.path.join(previous, "index.json"), "rb").read() == index_before
    assert [n for n in os.listdir(previous) if n.endswith(".tmp")], "the kill left no partial"
    outcomes = run_ranks(load_outcomes, 2, "NO_SHARD", [previous], snapshot)
    assert outcomes == [["ok"], ["ok"]]


def test_engine_async_save_resumes_on_another_world_size(tmp_path):
    """The DeepSpeed door's switch: the engine trains a step while the save is written;
    resumed on 3 ranks, the run continues from the saved step as the reference does."""
    save_dir = str(tmp_path)
    run_ranks(engine_cases.save_then_resume, 2, save_dir, 2, True)
    with open(os.path.join(save_dir, "latest"), encoding="utf-8") as handle:
        assert handle.read() == "global_step2"
    run_ranks(engine_cases.save_then_resume, 3, save_dir, 2)


def test_a_model_that_saved_asynchronously_is_freed(tmp_path):
    """Neither the FSDP2 door's record of a call (shardwrap/fsdp2/state.py) nor the
    model's saver ([Note: staging plans]) keeps the model: a door model that trained and
    saved asynchronously goes when the user drops it, its host arena with it. Negative
    control in the same test: the door's record kept in a weak map keyed by the module,
    as the door kept it before, keeps the model alive."""
    assert run_ranks(saved_model_is_collected, 2, str(tmp_path / "a"), False) == [True, True]
    assert run_ranks(saved_model_is_collected, 2, str(tmp_path / "b"), True) == [False, False]


def test_the_asynchronous_call_issues_no_collective_and_shares_a_bad_argument(tmp_path):
    """docs/checkpoints.md: an asynchronous save's call does no collective (the save id is
    agreed on the background thread), and a bad argument on one rank raises from every
    rank's ``result()``. Control in the same call: a synchronous save, recorded the same
    way, issues its collectives on the caller's thread."""
    for found in run_ranks(collectives_of_a_save_call, 2, str(tmp_path)):
        assert found["async"] == [], found
        assert found["sync"], found
        assert "rank 1" in found["bad_extra"] and "extra" in found["bad_extra"], found
