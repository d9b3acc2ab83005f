"""The resident peak of a disk-offloaded run (planner/resident.py) and ``--offload nvme``.

The figures themselves are checked against measured runs by benchmarks/bench_beyond_ram.py
(benchmarks/RESULTS.md); here: what the formulas must do whatever their constants.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwrap.__main__ import main
from shardwrap.planner.resident import DiskRunShape, resident_peak

SHAPE = DiskRunShape(
    num_params=2_530_000_000,
    world_size=2,
    layer_params=12 * 2560**2,
    hidden=2560,
    layers=30,
    tokens_per_rank=256,
    vocab=32000,
    sub_group_size=20_000_000,
)


@given(st.integers(min_value=1, max_value=10**13))
def test_the_peak_does_not_grow_with_the_model_but_the_files_do(num_params):
    """At a fixed layer shape only the files follow P: 16 bytes per parameter / N for Adam."""
    other = dataclasses.replace(SHAPE, num_params=num_params)
    assert resident_peak(other).total == resident_peak(SHAPE).total
    assert resident_peak(other).disk_bytes == -(-num_params // 2) * 16


@given(st.integers(min_value=1, max_value=10**9), st.integers(min_value=1, max_value=10**9))
def test_a_smaller_sub_group_never_raises_the_peak(small, large):
    small, large = sorted((small, large))
    peaks = [
        resident_peak(dataclasses.replace(SHAPE, sub_group_size=s)).moment_bytes("optimizer step")
        for s in (small, large)
    ]
    assert peaks[0] <= peaks[1]


def test_the_peak_is_the_highest_moment_and_counts_the_process_once():
    peak = resident_peak(SHAPE)
    moments = [peak.moment_bytes(m) for m, _ in peak.moments]
    assert peak.total == max(moments)
    no_process = resident_peak(dataclasses.replace(SHAPE, process_bytes=0))
    assert peak.total - no_process.total == SHAPE.process_bytes
    # Without a head unit there is no head moment.
    headless = resident_peak(dataclasses.replace(SHAPE, vocab=0))
    assert [m for m, _ in headless.moments] == ["backward through a layer", "optimizer step"]


@pytest.mark.parametrize(
    "field,value", [("world_size", 0), ("layers", True), ("sub_group_size", -1), ("hidden", 1.5)]
)
def test_bad_shapes_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(SHAPE, **{field: value})


def test_estimate_offload_nvme(capsys):
    argv = ["estimate", "--params", "2.53e9", "--world-size", "2", "--bf16", "--offload", "nvme"]
    shape = ["--layers", "30", "--hidden", "2560", "--vocab", "32000", "--tokens-per-rank", "256"]
    assert main([*argv, *shape, "--sub-group-size", "2e7"]) == 0
    out = capsys.readouterr().out
    assert "(disk)" in out and "resident peak per rank" in out
    assert "S b (2 + k) = 20,000,000 x 4 x 4" in out
    # The sub-group cannot hold more than the rank's shard.
    assert main([*argv, *shape, "--sub-group-size", "2e9"]) == 0
    assert "S b (2 + k) = 1,265,000,000 x 4 x 4" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--tp 1 --pp 1"):
        main([*argv, *shape, "--tp", "2"])
