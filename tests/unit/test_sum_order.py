"""gloo's reduce-scatter sum order as pure arithmetic (comm/sum_order.py), no process group.

The runs are checked against an element-by-element reading of [Note: gloo's sum order]:
each element of the own slice sits at a position of the peer's (after the peer's
paddings), that position in one ring block, and the block fixes the order. The order
against torch's collective itself is tests/dist/test_pairwise.py's.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwrap.comm.sum_order import (
    SumRun,
    gloo_block_numel,
    ring_order,
    sum_runs,
)


@st.composite
def slices(draw):
    size = draw(st.integers(2, 8))
    slice_numel = draw(st.one_of(st.integers(1, 40), st.integers(200_000, 2_000_000)))
    rank = draw(st.integers(0, size - 1))
    itemsize = draw(st.sampled_from([2, 4, 8]))
    padding = draw(st.integers(0, min(slice_numel - 1, 12)))
    offsets = sorted(draw(st.lists(st.integers(0, slice_numel - padding), max_size=3)))
    gaps, total = [], 0
    for index, offset in enumerate(offsets):  # split the padding over the offsets
        length = padding // len(offsets) if index < len(offsets) - 1 else padding - total
        if length:
            gaps.append((offset + total, length))
            total += length
    return rank, size, slice_numel, itemsize, tuple(gaps)


def _element_orders(rank, size, slice_numel, itemsize, gaps, count):
    """The order of each of the own slice's first ``count`` real elements, one by one."""
    block = gloo_block_numel(size, size * slice_numel, itemsize)
    padded = {offset + i for offset, length in gaps for i in range(length)}
    positions = itertools.islice((p for p in range(slice_numel) if p not in padded), count)
    return [ring_order((rank * slice_numel + p) // block, size) for p in positions]


@given(slices())
def test_runs_cover_the_slice_in_the_orders_of_their_elements(case):
    rank, size, slice_numel, itemsize, gaps = case
    runs = sum_runs(rank, size, slice_numel, itemsize, gaps)
    assert runs[0].start == 0 and runs[-1].end == slice_numel
    assert all(a.end == b.start for a, b in zip(runs, runs[1:], strict=False))
    assert all(run.end > run.start and sorted(run.order) == list(range(size)) for run in runs)
    # Of a long slice, the elements whose order can change: its start (walking the whole
    # slice element by element cost 24 s of the suite).
    count = 1000 if slice_numel > 1000 else slice_numel
    expected = _element_orders(rank, size, slice_numel, itemsize, gaps, count)
    for index, order in enumerate(expected):
        run = next(r for r in runs if r.start <= index < r.end)
        assert run.order == order, (index, run)


@given(st.integers(1, 64), st.integers(0, 10**8), st.sampled_from([1, 2, 4, 8]))
def test_blocks_cover_the_buffer_and_no_less_than_a_slice(size, numel, itemsize):
    """So only a slice's first elements can belong to the block before its own."""
    block = gloo_block_numel(size, numel, itemsize)
    assert size * block >= numel and block >= -(-numel // size)


def test_the_order_ends_with_the_blocks_own_rank():
    """Block b travels from rank b - 1 down the ring and ends at rank b."""
    assert ring_order(0, 3) == (2, 1, 0)
    assert ring_order(1, 4) == (0, 3, 2, 1)
    assert sum_runs(1, 3, 7, 4) == (SumRun(0, 1, (2, 1, 0)), SumRun(1, 7, (0, 2, 1)))


@pytest.mark.parametrize(
    ("args", "name"),
    [((3, 3, 7, 4), "rank"), ((0, 3, 7, 4, ((0, 0),)), "reference_gaps")],
)
def test_bad_arguments_are_named(args, name):
    with pytest.raises(ValueError, match=name):
        sum_runs(*args)
