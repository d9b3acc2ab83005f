"""Where local gradients go in a unit's flat gradient ([Note: packed gradients])."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwrap.layout.flat import FlatLayout
from shardwrap.layout.grad_slots import GradSlots, chunk_split

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
mixed_layouts = st.builds(
    lambda entries, num_shards: FlatLayout.build(
        [(f"p{i}", shape, trains) for i, (shape, trains) in enumerate(entries)], num_shards
    ),
    st.lists(st.tuples(shapes, st.booleans()), min_size=0, max_size=6),
    st.integers(1, 6),
)


@given(mixed_layouts)
def test_segments_and_gaps_tile_the_buffer_once(layout):
    slots = GradSlots.for_layout(layout)
    covered = sorted(
        [(s.start, s.end) for segments in slots.segments for s in segments if s.numel]
        + list(slots.gaps)
    )
    position = 0
    for start, end in covered:
        assert start == position
        position = end
    assert position == slots.numel == slots.num_chunks * slots.chunk_numel


@given(mixed_layouts)
def test_frozen_parameters_have_no_place_and_chunks_fit_the_largest_rank(layout):
    slots = GradSlots.for_layout(layout)
    for info, segments in zip(layout.params, slots.segments, strict=True):
        if not info.requires_grad:
            assert segments == ()
        else:  # every element once
            assert sum(s.numel for s in segments) == info.numel
    trainable_per_rank = [
        sum(p.numel for i, p in zip(layout.params, layout.pieces(r)) if i.requires_grad)
        for r in range(layout.num_shards)
    ]
    assert slots.chunk_numel >= max(trainable_per_rank, default=0)
    if all(i.requires_grad for i in layout.params):
        assert slots.chunk_numel == layout.shard_numel
    else:
        assert slots.chunk_numel == max(trainable_per_rank, default=0)


@given(mixed_layouts)
def test_a_unit_without_frozen_parameters_keeps_the_parameter_layout(layout):
    layout = FlatLayout.build([(i.fqn, i.shape, True) for i in layout.params], layout.num_shards)
    slots = GradSlots.for_layout(layout)
    for index, info in enumerate(layout.params):
        starts = sorted((s.start, s.param_start) for s in slots.segments[index])
        # each piece at the flat offset of the elements it holds
        assert all(start == info.offset + param_start for start, param_start in starts)


@settings(max_examples=60, deadline=None)
@given(mixed_layouts, st.integers(1, 4))
def test_a_simulated_reduce_scatter_gives_each_rank_its_shards_sum(layout, num_ranks):
    """Flatten every replica's gradients, sum the buffers, cut them into chunks: each
    rank's pieces must be the sum of its shard's trainable elements."""
    slots = GradSlots.for_layout(layout)
    grads = [
        [torch.randn(info.numel) if info.requires_grad else None for info in layout.params]
        for _ in range(num_ranks)
    ]
    total = torch.zeros(slots.numel)
    for replica in grads:
        buffer = torch.full((slots.numel,), float("nan"))
        for start, end in slots.gaps:
            buffer[start:end] = 0
        for index, segments in enumerate(slots.segments):
            for s in segments:
                buffer[s.start : s.end] = replica[index][s.param_start : s.param_end]
        total += buffer
    assert not total.isnan().any()
    chunks = total.view(slots.num_chunks, slots.chunk_numel)
    for rank in range(layout.num_shards):
        for index, (info, piece) in enumerate(zip(layout.params, layout.pieces(rank))):
            start, end = slots.piece_in_chunk(index, rank)
            if not info.requires_grad or not piece.numel:
                assert (start, end) == (0, 0)
                continue
            # the replicas added in the same order as ``total``: the same sums, exactly
            expected = sum(r[index][piece.param_start : piece.param_end] for r in grads)
            torch.testing.assert_close(chunks[rank][start:end], expected, rtol=0, atol=0)


@given(mixed_layouts)
def test_end_to_end_slots_are_the_trainable_gradients_concatenated(layout):
    slots = GradSlots.for_layout(layout)
    trainable = [i for i, info in enumerate(layout.params) if info.requires_grad]
    if layout.num_shards == 1 or len(trainable) == len(layout.params):
        assert slots.end_to_end == tuple(trainable)  # the common layouts take the fast path
    if slots.end_to_end is None:
        return
    position = 0
    for index in slots.end_to_end:
        numel = layout.params[index].numel
        assert [(s.param_start, s.param_end, s.start) for s in slots.segments[index]] == (
            [(0, numel, position)] if numel else []
        )
        position += numel
    assert all(start >= position for start, _ in slots.gaps)  # gaps only after them
    assert position + sum(end - start for start, end in slots.gaps) == slots.numel


@given(mixed_layouts, st.data())
def test_chunk_split_cuts_every_parameters_piece(layout, data):
    slots = GradSlots.for_layout(layout)
    rank = data.draw(st.integers(0, layout.num_shards - 1))
    pieces = [slots.piece_in_chunk(i, rank) for i in range(len(layout.params))]
    sizes, part_of = chunk_split(pieces, slots.chunk_numel)  # never out of order here
    assert sum(sizes) == slots.chunk_numel
    chunk = torch.arange(slots.chunk_numel)
    parts = chunk.split_with_sizes(sizes) if sizes else ()
    for (start, end), part in zip(pieces, part_of):
        if start == end:
            assert part is None
        else:
            assert torch.equal(parts[part], chunk[start:end])


def test_chunk_split_refuses_pieces_out_of_order():
    with pytest.raises(ValueError, match="pieces"):
        chunk_split([(4, 6), (0, 4)], 6)
    assert chunk_split([(0, 0), (2, 3)], 5) == ((2, 1, 2), (None, 1))
