"""The phase timer runs, times every phase, and shardwrap NO_SHARD trains as DDP does."""

from __future__ import annotations

import pytest

from benchmarks.bench_phases import PHASES, measure, parse_args
from tests.dist.harness import run_ranks


def test_bench_phases_smoke() -> None:
    impls = ["ddp", "sw_no_shard"]
    for summary in run_ranks(measure, 2, "1m", impls, 2, 1, 2):
        assert set(summary) == set(impls)
        for impl, row in summary.items():
            assert all(row["median_ms"][p] > 0 for p in PHASES), impl
            assert len(row["losses"]) == 2, impl
        # Same seed, same batches, power-of-two averaging: the losses agree to the bit.
        assert summary["sw_no_shard"]["losses"] == summary["ddp"]["losses"]


def test_bench_phases_refuses_a_process_wide_variant() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--impls", "ddp,sw_full_shard_inline_posts"])
