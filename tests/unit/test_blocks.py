"""Tensor-parallel block arithmetic (shardwrap/layout/blocks.py), checked against torch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwrap.layout.blocks import Block, block_runs, chunk_span, sharded_block


@given(st.integers(0, 40), st.integers(1, 9))
def test_chunk_span_is_torch_chunk(size, num_chunks):
    chunks = torch.arange(size).chunk(num_chunks) if size else ()
    for index in range(num_chunks):
        offset, length = chunk_span(size, num_chunks, index)
        if index < len(chunks):
            expected = chunks[index]
            assert length == expected.numel()
            assert length == 0 or offset == int(expected[0])
        else:  # torch.chunk returns fewer chunks; DTensor gives these ranks empty blocks
            assert length == 0


@st.composite
def blocks_and_ranges(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
    shards = []
    for dim in draw(st.sets(st.integers(0, max(len(shape) - 1, 0)), max_size=2)) if shape else ():
        num_chunks = draw(st.integers(1, 4))
        shards.append((dim, num_chunks, draw(st.integers(0, num_chunks - 1))))
    block = sharded_block(shape, shards)
    start = draw(st.integers(0, block.numel))
    return block, start, draw(st.integers(start, block.numel))


@settings(max_examples=300)
@given(blocks_and_ranges())
def test_runs_cover_the_range_and_point_at_the_block(case):
    block, start, end = case
    whole = torch.arange(math.prod(block.global_shape)).reshape(block.global_shape)
    local = whole
    for dim, (offset, length) in enumerate(zip(block.offsets, block.shape, strict=True)):
        local = local.narrow(dim, offset, length)
    local_flat = local.reshape(-1)
    runs = block_runs(block, start, end)
    position = start
    for lo, hi, global_start in runs:
        assert lo == position and hi > lo
        # Contiguous in the global tensor: the run's elements are consecutive indices.
        expected = torch.arange(global_start, global_start + hi - lo)
        assert torch.equal(local_flat[lo:hi], expected)
        position = hi
    assert position == end
    # Maximal: no run continues the one before it in the global tensor.
    for (lo, hi, g), (_, _, g2) in zip(runs, runs[1:]):
        assert g + (hi - lo) != g2


def test_row_split_weight_is_one_run_per_row_and_column_split_one_run():
    rowwise = sharded_block((4, 8), [(1, 2, 1)])  # Shard(1): rank 1 holds columns 4..7
    runs = [(0, 4, 4), (4, 8, 12), (8, 12, 20), (12, 16, 28)]
    assert block_runs(rowwise, 0, rowwise.numel) == runs
    colwise = sharded_block((4, 8), [(0, 2, 1)])  # Shard(0): rows 2..3, one range
    assert block_runs(colwise, 3, 16) == [(3, 16, 19)]


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="two mesh dims"):
        sharded_block((4, 4), [(0, 2, 0), (0, 2, 1)])
    with pytest.raises(ValueError, match="leaves the global shape"):
        Block((4,), (3,), (2,))
    with pytest.raises(ValueError, match="outside"):
        block_runs(Block((4,), (0,), (2,)), 0, 3)
