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

from .layout import FlatLayout


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

    ``segments[i]``: where parameter ``i``'s gradient goes, one segment per chunk that
    holds some of it (none for a frozen parameter). ``gaps``: the ranges no segment
    covers, zeros on the wire.
    """

    segments: tuple[tuple[Segment, ...], ...]
    num_chunks: int
    chunk_numel: int
    gaps: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.num_chunks * self.chunk_numel

    @staticmethod
    def for_layout(layout: FlatLayout) -> GradSlots:
        """The buffer of [Note: packed gradients] for ``layout``."""
        num_chunks = layout.num_shards
        chunks = [
            [
                (index, piece)
                for index, (info, piece) in enumerate(
                    zip(layout.params, layout.pieces(rank), strict=True)
                )
                if info.requires_grad and piece.numel
            ]
            for rank in range(num_chunks)
        ]
        used = [sum(piece.numel for _, piece in chunk) for chunk in chunks]
        all_trainable = all(info.requires_grad for info in layout.params)
        chunk_numel = layout.shard_numel if all_trainable else max(used, default=0)
        segments: list[list[Segment]] = [[] for _ in layout.params]
        gaps = []
        for rank, chunk in enumerate(chunks):
            position = rank * chunk_numel
            for index, piece in chunk:
                segments[index].append(Segment(piece.param_start, piece.param_end, position))
                position += piece.numel
            if used[rank] < chunk_numel:
                gaps.append((position, (rank + 1) * chunk_numel))
        return GradSlots(tuple(map(tuple, segments)), num_chunks, chunk_numel, tuple(gaps))

    def piece_in_chunk(self, index: int, chunk: int) -> tuple[int, int]:
        """Parameter ``index``'s ``[start, end)`` inside reduced chunk ``chunk``
        (``(0, 0)`` when the chunk holds none of it)."""
        base = chunk * self.chunk_numel
        for segment in self.segments[index]:
            if base <= segment.start < base + self.chunk_numel:
                return segment.start - base, segment.end - base
        return 0, 0
