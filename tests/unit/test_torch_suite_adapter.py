"""benchmarks/torch_suite swaps torch's FSDP2 names before a test module imports them.

A stand-in for one of torch's test files (written here, not torch's) binds the names at
import, as torch's files do, and checks what it bound; the adapter's worker runs it in a
fresh process in each column. Control: the torch column sees torch's own names, so the same
file fails there.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.torch_suite.run import run_one

STAND_IN = """
import unittest

from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule


class TestNames(unittest.TestCase):
    def test_bound_at_import_are_shardwraps(self):
        import shardwrap

        self.assertIs(fully_shard, shardwrap.fully_shard)
        self.assertIs(FSDPModule, shardwrap.FSDPModule)

    @unittest.skip("recorded as a skip")
    def test_skipped(self):
        pass
"""


def test_the_shardwrap_column_sees_shardwraps_names_and_the_torch_column_torchs(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_names_stand_in.py").write_text(STAND_IN)
    path: Path = tests / "test_names_stand_in.py"
    key = "test_names_stand_in.TestNames.test_bound_at_import_are_shardwraps"
    skipped = "test_names_stand_in.TestNames.test_skipped"
    ours = run_one(path, "shardwrap", 300, [], tmp_path)
    theirs = run_one(path, "torch", 300, [], tmp_path)
    assert ours[key]["status"] == "pass", ours
    assert theirs[key]["status"] == "fail", theirs  # the control
    assert ours[skipped]["status"] == theirs[skipped]["status"] == "skip"
