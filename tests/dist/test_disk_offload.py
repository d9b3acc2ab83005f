"""DiskOffload trains exactly like memory, on several ranks and strategies."""

from __future__ import annotations

import os

from tests.dist import disk_cases
from tests.dist.harness import run_ranks


def test_disk_offload_matches_memory(tmp_path) -> None:
    leftovers = run_ranks(disk_cases.both_strategies, 3, str(tmp_path))
    assert leftovers == [[], [], []]
    assert os.listdir(tmp_path) == [], "every rank's scratch directory is removed at exit"
