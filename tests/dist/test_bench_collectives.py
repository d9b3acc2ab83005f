"""The collectives benchmark runs, and every variant agrees with torch's result."""

from __future__ import annotations

from benchmarks.bench_collectives import measure
from tests.dist.harness import run_ranks

VARIANTS = {
    "all_gather torch",
    "all_gather shardwrap",
    "all_reduce torch",
    "reduce_scatter torch",
    "reduce_scatter shardwrap",
}


def test_bench_collectives_smoke() -> None:
    for results in run_ranks(measure, 3, 3001, 1):  # 3001: trimmed to a multiple of 3
        assert set(results) == VARIANTS
        for name, row in results.items():
            assert row["matches_torch"], name
            assert row["wall_ms"] > 0 and row["cpu_ms"] >= 0, name
