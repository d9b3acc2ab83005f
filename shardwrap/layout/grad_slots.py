"""Pure arithmetic: where each parameter's local gradient goes in a unit's flat gradient.

[Note: packed gradients]
A unit's local gradients are flattened into one buffer that a single collective reduces.
The buffer is cut into one equal chunk per shard: a reduce-scatter leaves rank ``r`` the
sum of everyone's chunk ``r``, and with one shard an all-reduce sums the whole. Chunk
``r`` must hold the gradients of exactly the parameter elements that rank ``r``'s shard
owns, but nothing fixes where inside the chunk, and a frozen element, which never has a
gradient, needs no place at all. So chunk ``r`` holds the trainable part of shard ``r``
end to end, in layout order, and every chunk is as long as the longest such part:

* one shard (NO_SHARD, or a unit kept whole by the persistence threshold): the trainable
  parameters alone, as DDP's buckets hold them;
* a unit with no frozen parameter: exactly the parameter layout (its padding at the end
  of the last chunk), so nothing changes for ordinary training;
* a sharded unit that mixes frozen and trainable parameters (adapters beside frozen
  weights): N times the largest rank's trainable part instead of N times the shard.
  Spread evenly, that is about the trainable size; in the worst case (all trainable
  elements on one rank) it is the shard, as before.

Frozen elements thus cost nothing on the wire or in a kept gradient buffer. Everything
here depends on the layout alone, so all ranks agree on the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .chunks import ChunkLayout
from .flat import FlatLayout, ShardPiece


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``[param_start, param_end)`` of a flattened parameter, at ``start``."""

    param_start: int
    param_end: int
    start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True, slots=True)
class GradSlots:
    """A unit's flat gradient buffer: ``num_chunks`` chunks of ``chunk_numel`` elements.

    ``segments[i]``: where parameter ``i``'s gradient goes: one contiguous segment when
    the buffer follows the parameter layout, else one per chunk that holds some of it
    (none for a frozen parameter). ``gaps``: the ranges no segment covers, zeros on the
    wire.
    """

    segments: tuple[tuple[Segment, ...], ...]
    num_chunks: int
    chunk_numel: int
    gaps: tuple[tuple[int, int], ...]
    # The trainable parameters, in order, when their gradients lie whole and end to end
    # from element 0 (every unit without frozen parameters, any one-shard unit): the
    # buffer is then their concatenation followed by the gaps. None otherwise.
    end_to_end: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return self.num_chunks * self.chunk_numel

    @staticmethod
    def for_layout(layout: FlatLayout | ChunkLayout) -> GradSlots:
        """The buffer of [Note: packed gradients] for ``layout``.

        Work grows with the number of parameter pieces, not with parameters times ranks.
        """
        trainable = all(info.requires_grad for info in layout.params)
        if trainable and layout.shards_are_contiguous:  # the parameter layout
            segments = tuple(
                (Segment(0, info.numel, info.offset),) if info.numel else ()
                for info in layout.params
            )
            gaps = ((layout.unpadded_numel, layout.padded_numel),) if layout.num_padding else ()
            return GradSlots(
                segments,
                layout.num_shards,
                layout.shard_numel,
                gaps,
                _end_to_end(layout, segments),
            )
        pieces_by_rank: dict[int, list[tuple[int, ShardPiece]]] = {}
        for index, info in enumerate(layout.params):
            if info.requires_grad:
                for rank, piece in layout.rank_pieces(index):
                    pieces_by_rank.setdefault(rank, []).append((index, piece))
        used = {r: sum(p.numel for _, p in pieces) for r, pieces in pieces_by_rank.items()}
        chunk_numel = max(used.values(), default=0)
        placed: list[list[Segment]] = [[] for _ in layout.params]
        for rank, pieces in pieces_by_rank.items():
            position = rank * chunk_numel
            for index, piece in pieces:
                placed[index].append(Segment(piece.param_start, piece.param_end, position))
                position += piece.numel
        gaps = tuple(
            (rank * chunk_numel + used.get(rank, 0), (rank + 1) * chunk_numel)
            for rank in range(layout.num_shards)
            if used.get(rank, 0) < chunk_numel
        )
        segments = tuple(map(tuple, placed))
        return GradSlots(
            segments, layout.num_shards, chunk_numel, gaps, _end_to_end(layout, segments)
        )

    def piece_in_chunk(self, index: int, chunk: int) -> tuple[int, int]:
        """Parameter ``index``'s ``[start, end)`` inside reduced chunk ``chunk``
        (``(0, 0)`` when the chunk holds none of it)."""
        base = chunk * self.chunk_numel
        for segment in self.segments[index]:
            start = max(segment.start, base)
            end = min(segment.end, base + self.chunk_numel)
            if start < end:  # a parameter's elements in one chunk are contiguous
                return start - base, end - base
        return 0, 0


def _end_to_end(
    layout: FlatLayout | ChunkLayout, segments: tuple[tuple[Segment, ...], ...]
) -> tuple[int, ...] | None:
    """``GradSlots.end_to_end`` of ``segments``."""
    trainable = tuple(i for i, info in enumerate(layout.params) if info.requires_grad)
    position = 0
    for index in trainable:
        numel = layout.params[index].numel
        if numel and segments[index] != (Segment(0, numel, position),):
            return None
        position += numel
    return trainable


def chunk_split(
    pieces: list[tuple[int, int]], chunk_numel: int
) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
    """Cut a reduced chunk into every parameter's piece with one ``split_with_sizes``.

    ``pieces``: each parameter's ``[start, end)`` in the chunk (``(0, 0)``: none), in
    parameter order, as every chunk of :class:`GradSlots` holds them. Returns the sizes to
    split the chunk by (gaps included) and, per parameter, which part is its piece (None
    for an empty piece).
    """
    sizes: list[int] = []
    part_of: list[int | None] = []
    position = 0
    for start, end in pieces:
        if start == end:
            part_of.append(None)
            continue
        if start < position:
            raise ValueError(f"pieces: ({start}, {end}) starts before the one before ends")
        if start > position:
            sizes.append(start - position)
        part_of.append(len(sizes))
        sizes.append(end - start)
        position = end
    if position < chunk_numel:
        sizes.append(chunk_numel - position)
    return tuple(sizes), tuple(part_of)


def peer_slices(
    layout: FlatLayout | ChunkLayout, slots: GradSlots, chunk: int
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...] | None]:
    """What the reduce-scatter of ``slots`` may know of its chunks, for chunk ``chunk``'s
    rank: FSDP2's paddings inside it (``ChunkLayout.reference_gaps``: the sum order), and
    under a chunk layout each chunk's real elements (at its front: the rest, padding, is
    not sent). A flat layout's reduce-scatter is torch FSDP1's own: neither."""
    if not isinstance(layout, ChunkLayout):
        return (), None
    real = [slots.chunk_numel] * slots.num_chunks
    for start, end in slots.gaps:  # each a chunk's tail
        real[start // slots.chunk_numel] -= end - start
    return layout.reference_gaps(chunk), tuple(real)
