"""A rank killed in the middle of a save: the previous checkpoint survives, the partial one
is reported as incomplete (not loaded half-written)."""

from __future__ import annotations

import os

import pytest

from tests.dist.ckpt_workers import assemble, crash_phase, load_outcomes, phase
from tests.dist.harness import run_ranks


def test_killed_rank_leaves_previous_checkpoint_loadable(tmp_path):
    previous = str(tmp_path / "step2")
    partial = str(tmp_path / "step4")
    snapshot = assemble(run_ranks(phase, 2, "FULL_SHARD", None, previous, None, 0))
    index_before = open(os.path.join(previous, "index.json"), "rb").read()

    # Into a new folder, and over the previous checkpoint's own folder.
    for target in (partial, previous):
        with pytest.raises(AssertionError) as failure:
            run_ranks(crash_phase, 2, previous, target, snapshot, fresh=True)  # kills rank 1
        # Rank 0 learns of the death inside save_checkpoint's agreement, and gives up.
        assert "in save_checkpoint" in str(failure.value), str(failure.value)[-2000:]

    assert open(os.path.join(previous, "index.json"), "rb").read() == index_before
    leftovers = sorted(os.listdir(partial))
    assert "index.json" not in leftovers and leftovers, leftovers
    outcomes = run_ranks(load_outcomes, 2, "NO_SHARD", [previous, partial], snapshot)
    previous_ok, partial_error = outcomes[1]  # the replica that does not save
    assert previous_ok == "ok"
    assert "incomplete" in partial_error and "no index.json" in partial_error, partial_error
