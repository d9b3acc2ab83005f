"""DiskOffload trains exactly like memory, on several ranks and strategies."""

from __future__ import annotations

import os

from tests.dist import disk_cases
from tests.dist.harness import run_ranks


def test_disk_offload_matches_memory(tmp_path) -> None:
    leftovers = run_ranks(disk_cases.both_strategies, 3, str(tmp_path))
    assert leftovers == [[], [], []]
    assert os.listdir(tmp_path) == [], "every rank's scratch directory is removed at exit"


def test_streamed_step_matches_memory(tmp_path) -> None:
    """sub_group_size cuts the step into pieces; nothing changes bit for bit (3 ranks pad)."""
    scratch, checkpoints = tmp_path / "scratch", tmp_path / "checkpoints"
    scratch.mkdir()
    leftovers = run_ranks(disk_cases.streamed_cases, 3, str(scratch), str(checkpoints))
    assert leftovers == [[], [], []]
    assert os.listdir(scratch) == []
