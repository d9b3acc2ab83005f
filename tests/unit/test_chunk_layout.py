"""The FSDP2 door's dim-0 chunk layout (layout/chunks.py), without a process group.

The reference is ``torch.chunk`` itself: every rank's local tensor, cut out of its shard
by the layout's pieces, must equal torch's chunk of the parameter (FSDP2's local tensor),
shape included, empty where the rows run out. Negative control: a layout whose pieces
start one row late (``_shifted``) fails ``test_pieces_are_torch_chunks``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwrap.core.chunk_copy import copy_out, take_shard
from shardwrap.layout.chunks import ChunkLayout, chunk_rows
from shardwrap.layout.flat import FlatLayout, ShardPiece
from shardwrap.layout.grad_slots import GradSlots

shapes = st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple)
named = st.lists(st.tuples(shapes, st.booleans()), min_size=0, max_size=6)


def build(entries, num_shards: int) -> ChunkLayout:
    return ChunkLayout.build(
        [(f"p{i}", shape, grad) for i, (shape, grad) in enumerate(entries)], num_shards
    )


def local_tensors(layout, pieces, shard, rank):
    return [
        shard[p.shard_start : p.shard_end].view(layout.local_shape(i, rank))
        for i, p in enumerate(pieces)
    ]


@given(st.integers(0, 40), st.integers(1, 9))
def test_chunk_rows_are_torch_chunks(num_rows, num_shards):
    chunks = torch.arange(num_rows).chunk(num_shards)
    for rank in range(num_shards):
        start, end = chunk_rows(num_rows, num_shards, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, end)) == expected


def pieces_match_torch_chunks(layout, params, pieces_of) -> bool:
    """Whether every local tensor cut out of a shard built by ``pieces_of(rank)`` equals
    torch's chunk (shape and values)."""
    num_shards = layout.num_shards
    for rank in range(num_shards):
        pieces = pieces_of(rank)
        shard = torch.full((layout.shard_numel,), float("nan"))
        for param, piece in zip(params, pieces, strict=True):
            shard[piece.shard_start : piece.shard_end] = param.reshape(-1)[
                piece.param_start : piece.param_end
            ]
        for index, local in enumerate(local_tensors(layout, pieces, shard, rank)):
            chunks = params[index].chunk(num_shards) if params[index].shape[0] else ()
            expected = chunks[rank] if rank < len(chunks) else params[index].new_empty(local.shape)
            if local.shape != expected.shape or not torch.equal(local, expected):
                return False
    return True


@settings(max_examples=80, deadline=None)
@given(named, st.integers(1, 5))
def test_pieces_are_torch_chunks(entries, num_shards):
    layout = build(entries, num_shards)
    params = [torch.randn(shape) for shape, _ in entries]
    assert pieces_match_torch_chunks(layout, params, layout.pieces)


@settings(max_examples=80, deadline=None)
@given(named, st.integers(1, 5))
def test_shards_are_end_to_end_and_rank_zero_is_longest(entries, num_shards):
    layout = build(entries, num_shards)
    totals = []
    for rank in range(num_shards):
        position = 0
        for piece in layout.pieces(rank):
            if piece.numel:
                assert piece.shard_start == position
            position += piece.numel
        totals.append(position)
    assert layout.shard_numel == max(totals, default=0) == totals[0]
    assert layout.padded_numel >= layout.unpadded_numel
    assert layout.num_padding == layout.padded_numel - layout.unpadded_numel


@settings(max_examples=80, deadline=None)
@given(named, st.integers(1, 5))
def test_rank_pieces_cover_each_parameter_in_order(entries, num_shards):
    layout = build(entries, num_shards)
    for index, info in enumerate(layout.params):
        position = 0
        for _, piece in layout.rank_pieces(index):
            assert piece.param_start == position and piece.numel > 0
            position = piece.param_end
        assert position == info.numel


@settings(max_examples=60, deadline=None)
@given(named, st.integers(1, 5))
def test_grad_slots_send_each_gradient_to_its_owner(entries, num_shards):
    """Reduce-scattering the packed buffer leaves each rank exactly its shard's gradients."""
    layout = build(entries, num_shards)
    slots = GradSlots.for_layout(layout)
    grads = [torch.randn(shape) for shape, _ in entries]
    flat = torch.zeros(slots.numel)
    for index, segments in enumerate(slots.segments):
        for s in segments:
            flat[s.start : s.end] = grads[index].reshape(-1)[s.param_start : s.param_end]
    for rank in range(num_shards):
        chunk = flat[rank * slots.chunk_numel : (rank + 1) * slots.chunk_numel]
        for index, piece in enumerate(layout.pieces(rank)):
            start, end = slots.piece_in_chunk(index, rank)
            if not entries[index][1]:  # frozen: no slot
                assert start == end
                continue
            expected = grads[index].reshape(-1)[piece.param_start : piece.param_end]
            assert torch.equal(chunk[start:end], expected)


@given(named)
def test_one_shard_is_the_flat_layout(entries):
    chunked = build(entries, 1)
    flat = FlatLayout.build([(f"p{i}", s, g) for i, (s, g) in enumerate(entries)], 1)
    assert chunked.pieces(0) == flat.pieces(0)
    assert chunked.shards_are_contiguous and chunked.padded_numel == flat.padded_numel
    assert GradSlots.for_layout(chunked) == GradSlots.for_layout(flat)


def test_uneven_rows_leave_the_last_rank_empty():
    layout = ChunkLayout.build([("w", (4, 3), True), ("b", (5,), True)], 3)
    assert [layout.local_shape(0, r) for r in range(3)] == [(2, 3), (2, 3), (0, 3)]
    assert [layout.local_shape(1, r) for r in range(3)] == [(2,), (2,), (1,)]
    assert layout.shard_numel == 8 and layout.owners(0) == (0, 1)
    with pytest.raises(ValueError, match="shard_range"):
        layout.shard_range(0)


def _shifted(layout: ChunkLayout, rank: int) -> tuple[ShardPiece, ...]:
    """The negative control: pieces one row late (a wrong chunk order)."""
    out = []
    for index, piece in enumerate(layout.pieces(rank)):
        row = layout.params[index].numel // max(layout.params[index].shape[0], 1)
        shift = row if piece.param_end + row <= layout.params[index].numel else 0
        out.append(
            ShardPiece(piece.param_start + shift, piece.param_end + shift, piece.shard_start)
        )
    return tuple(out)


def test_negative_control_a_shifted_chunk_is_caught():
    layout = ChunkLayout.build([("w", (5, 2), True), ("b", (3,), True)], 2)
    params = [torch.randn(5, 2), torch.randn(3)]
    assert pieces_match_torch_chunks(layout, params, layout.pieces)
    assert not pieces_match_torch_chunks(layout, params, lambda r: _shifted(layout, r))


def gather_round_trip(layout: ChunkLayout, params: list[torch.Tensor], rank_order) -> bool:
    """Shards taken from a full buffer, 'all-gathered' in ``rank_order`` and copied out:
    whether every parameter comes back."""
    full = torch.full((layout.padded_numel,), float("nan"))
    for info, param in zip(layout.params, params, strict=True):
        full[info.offset : info.end] = param.reshape(-1)
    shards = [take_shard(layout, full, rank) for rank in range(layout.num_shards)]
    gathered = torch.cat([shards[r] for r in rank_order]) if shards else torch.zeros(0)
    out = torch.full((layout.padded_numel,), float("nan"))
    copy_out(layout, gathered, out)
    return all(
        torch.equal(out[info.offset : info.end].view(info.shape), param)
        for info, param in zip(layout.params, params, strict=True)
    )


@settings(max_examples=60, deadline=None)
@given(named, st.integers(1, 5), st.sampled_from([1, 4, 64]))
def test_aligned_full_buffer_round_trips_through_the_shards(entries, num_shards, align):
    layout = ChunkLayout.build(
        [(f"p{i}", s, g) for i, (s, g) in enumerate(entries)], num_shards, align_numel=align
    )
    assert all(info.offset % align == 0 for info in layout.params)
    assert layout.pieces(0) == build(entries, num_shards).pieces(0)  # shards: unaligned
    assert layout.padded_numel >= max(layout.unpadded_numel, layout.gathered_numel)
    params = [torch.randn(shape) for shape, _ in entries]
    assert gather_round_trip(layout, params, range(num_shards))


def test_negative_control_shards_gathered_out_of_order_do_not_round_trip():
    layout = ChunkLayout.build([("w", (5, 2), True), ("b", (3,), True)], 3, align_numel=64)
    params = [torch.randn(5, 2), torch.randn(3)]
    assert gather_round_trip(layout, params, [0, 1, 2])
    assert not gather_round_trip(layout, params, [1, 0, 2])


@given(named, st.integers(1, 5), st.data())
def test_reference_gaps_are_fsdp2s_chunk_padding(entries, num_shards, data):
    """FSDP2's gradient chunk ``r``, built with ``torch.chunk``: each trainable parameter's
    chunk padded to rank 0's; the padding's positions are the reference gaps'. Negative
    control (run once): frozen parameters counted too fails it."""
    layout = build(entries, num_shards)
    rank = data.draw(st.integers(0, num_shards - 1))
    padded = []
    for i, (shape, grad) in enumerate(entries):
        if not grad:
            continue
        rows = torch.empty(shape).reshape(shape or (1,))  # a scalar is one row of one
        # torch.chunk returns fewer chunks where the rows run out; FSDP2 pads the list
        sizes = [c.numel() for c in rows.chunk(num_shards)]
        sizes += [0] * num_shards
        padded += [i] * sizes[rank] + [None] * (sizes[0] - sizes[rank])
    gaps = layout.reference_gaps(rank)
    positions = [offset + k for offset, length in gaps for k in range(length)]
    assert positions == [p for p, owner in enumerate(padded) if owner is None]
