"""Shard arithmetic, without a process group."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwrap.layout.flat import FlatLayout, padded_numel, piece_of, shard_range

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
layouts = st.builds(
    lambda shape_list, num_shards: FlatLayout.build(
        [(f"p{i}", s, i % 2 == 0) for i, s in enumerate(shape_list)], num_shards
    ),
    st.lists(shapes, min_size=0, max_size=6),
    st.integers(1, 8),
)


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_padding_is_the_smallest_multiple(numel, num_shards):
    padded = padded_numel(numel, num_shards)
    assert padded % num_shards == 0
    assert numel <= padded < numel + num_shards


@given(st.integers(0, 1000), st.integers(1, 16))
def test_shard_ranges_tile_the_padded_buffer(numel, num_shards):
    ranges = [shard_range(numel, num_shards, r) for r in range(num_shards)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == padded_numel(numel, num_shards)
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end == start
    assert len({end - start for start, end in ranges}) == 1


@given(layouts)
def test_pieces_cover_every_element_exactly_once(layout):
    covered = {i: [0] * info.numel for i, info in enumerate(layout.params)}
    for shard in range(layout.num_shards):
        start, end = layout.shard_range(shard)
        for index, piece in enumerate(layout.pieces(shard)):
            info = layout.params[index]
            assert 0 <= piece.shard_start and piece.shard_end <= end - start
            # the piece sits where the flat buffer puts those elements
            if piece.numel:
                assert start + piece.shard_start == info.offset + piece.param_start
            for k in range(piece.param_start, piece.param_end):
                covered[index][k] += 1
    assert all(count == 1 for counts in covered.values() for count in counts)


@given(layouts)
def test_owners_are_the_shards_with_nonempty_pieces(layout):
    for index in range(len(layout.params)):
        expected = tuple(s for s in range(layout.num_shards) if layout.pieces(s)[index].numel > 0)
        assert layout.owners(index) == expected


@settings(max_examples=50)
@given(layouts, st.randoms(use_true_random=False))
def test_flatten_shard_unflatten_round_trip(layout, rnd):
    tensors = [
        torch.tensor([rnd.random() for _ in range(i.numel)]).view(i.shape) for i in layout.params
    ]
    flat = torch.zeros(layout.padded_numel)
    for info, t in zip(layout.params, tensors):
        flat[info.offset : info.end] = t.reshape(-1)
    shards = [flat[slice(*layout.shard_range(s))].clone() for s in range(layout.num_shards)]
    rebuilt = torch.cat(shards)
    assert rebuilt[layout.unpadded_numel :].eq(0).all()
    for info, t in zip(layout.params, tensors):
        assert torch.equal(rebuilt[info.offset : info.end].view(info.shape), t)
        # and from the pieces alone
        parts = []
        for s in range(layout.num_shards):
            piece = layout.pieces(s)[layout.params.index(info)]
            parts.append(shards[s][piece.shard_start : piece.shard_end])
        assert torch.equal(torch.cat(parts).view(info.shape), t)


def test_piece_outside_range_is_empty():
    layout = FlatLayout.build([("a", (3,), True), ("b", (5,), True)], 4)
    info = layout.params[0]
    assert piece_of(info, 3, 6).numel == 0
    assert layout.shard_numel == 2 and layout.num_padding == 0
    assert [p.numel for p in layout.pieces(1)] == [1, 1]


def test_layout_sizes_match_shapes():
    layout = FlatLayout.build([("w", (3, 4), True), ("b", (4,), False)], 3)
    assert layout.unpadded_numel == 16
    assert layout.padded_numel == 18 and layout.num_padding == 2
    assert [i.numel for i in layout.params] == [12, 4]
    assert math.prod(layout.params[0].shape) == 12


@pytest.mark.parametrize(
    "call",
    [
        lambda: padded_numel(-1, 2),
        lambda: padded_numel(4, 0),
        lambda: shard_range(4, 2, 2),
        lambda: FlatLayout.build([("a", (2,), True)], 0),
    ],
)
def test_bad_numbers_are_rejected(call):
    with pytest.raises(ValueError):
        call()
