"""Pure arithmetic: the order in which torch's gloo backend adds a reduce-scatter's terms.

[Note: gloo's sum order]
torch's gloo ``reduce_scatter_tensor`` all-reduces the whole input with gloo's ring
algorithm and keeps this rank's slice. The ring cuts the buffer into ``size`` equal
blocks (of whole segments; see :func:`gloo_block_numel`); block ``b`` starts at rank
``b - 1`` and travels down the ring, each rank adding its own term to what it received,
until rank ``b`` adds the last. Element by element the sum is therefore
``((x[b-1] + x[b-2]) + ...) + x[b]`` (ranks modulo ``size``), with ``b`` the block the
element's position falls in. Blocks are a little longer than the reduce-scatter's slices
whenever the segments do not divide the buffer, so the first elements of rank ``r``'s
slice may belong to block ``r - 1``.

With three or more ranks the order changes the rounding, so a pairwise reduce-scatter that
adds in this order equals torch's gloo collective bit for bit, and with it torch's FSDP1
and FSDP2 on CPU (checked against torch's own collective for 2 to 8 ranks, fp32 and bf16,
up to 10M elements, on torch 2.13.0, 2.14.1 and 2.15.0: ``tests/dist/test_pairwise.py``).

A peer that lays out a rank's slice with padding inside it (FSDP2 pads every parameter's
dim-0 chunk; shardwrap's FSDP2 door pads only the chunk's end) puts the same element at
another position, so another block may own it. ``reference_gaps`` names those paddings, as
``(offset, length)`` in the peer's slice; positions are then translated to the peer's.
"""

from __future__ import annotations

from dataclasses import dataclass

# gloo's default largest ring segment (AllreduceOptions' maxSegmentSize, which torch's
# ProcessGroupGloo leaves unset); fitted to, then checked against, torch's collective.
GLOO_MAX_SEGMENT_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class SumRun:
    """Elements ``[start, end)`` of a rank's slice, summed over ranks in ``order``."""

    start: int
    end: int
    order: tuple[int, ...]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def gloo_block_numel(size: int, numel: int, itemsize: int) -> int:
    """Elements of each block of gloo's ring all-reduce over ``numel`` elements on ``size``
    ranks: a whole number of equal segments, at least two per rank, none over
    :data:`GLOO_MAX_SEGMENT_BYTES`, each a whole number of elements."""
    if size < 1 or numel < 0 or itemsize < 1:
        raise ValueError(f"size, numel, itemsize must be >= 1, >= 0, >= 1: {size, numel, itemsize}")
    total_bytes = numel * itemsize
    max_segment = itemsize * max(1, GLOO_MAX_SEGMENT_BYTES // itemsize)
    num_segments = _round_up(max(-(-total_bytes // max_segment), 2 * size), size)
    segment_bytes = _round_up(-(-total_bytes // num_segments), itemsize)
    return (num_segments // size) * segment_bytes // itemsize


def ring_order(block: int, size: int) -> tuple[int, ...]:
    """The ranks whose terms gloo's ring adds, first to last, for block ``block``."""
    return tuple((block - step) % size for step in range(1, size + 1))


def _to_own(reference_offset: int, gaps: tuple[tuple[int, int], ...]) -> int:
    """How many of the own slice's elements sit before ``reference_offset`` in the peer's."""
    hidden = sum(min(length, max(0, reference_offset - offset)) for offset, length in gaps)
    return reference_offset - hidden


def sum_runs(
    rank: int,
    size: int,
    slice_numel: int,
    itemsize: int,
    reference_gaps: tuple[tuple[int, int], ...] = (),
) -> tuple[SumRun, ...]:
    """Rank ``rank``'s slice of a reduce-scatter over ``size`` slices of ``slice_numel``,
    cut where gloo's order changes ([Note: gloo's sum order]); the runs cover the slice."""
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    if any(length < 1 or offset < 0 for offset, length in reference_gaps):
        raise ValueError(f"reference_gaps must be (offset >= 0, length >= 1): {reference_gaps}")
    block = max(1, gloo_block_numel(size, size * slice_numel, itemsize))
    start, end = rank * slice_numel, (rank + 1) * slice_numel
    runs = []
    position = start  # in the peer's slice, from the buffer's start
    while position < end:
        index = position // block
        stop = min(end, (index + 1) * block)
        own_start = _to_own(position - start, reference_gaps)
        own_stop = slice_numel if stop == end else _to_own(stop - start, reference_gaps)
        if own_stop > own_start:
            runs.append(SumRun(own_start, own_stop, ring_order(index, size)))
        position = stop
    return tuple(runs)
