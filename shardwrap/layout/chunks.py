"""Pure shard arithmetic for the FSDP2 door: each rank holds every parameter's dim-0 chunk.

[Note: the dim-0 chunk layout]
FSDP2 shows each parameter as a ``DTensor`` sharded ``Shard(0)``: rank ``r``'s local
tensor is ``torch.chunk(param, num_shards, dim=0)[r]``, the rows
``[r * c, (r + 1) * c)`` clipped to the row count, with ``c = ceil(rows / num_shards)``;
the last ranks' chunks may be short or empty. For those local tensors to be views of a
unit's flat shard, rank ``r``'s shard is the concatenation, in parameter order, of every
parameter's chunk ``r`` (a dim-0 chunk of a row-major tensor is one contiguous range of
its flattened elements), padded at its end to the longest rank's total (rank 0's: chunks
never grow with the rank).

The all-gather still moves ``num_shards`` equal shards, but the gathered buffer is in
rank order, not parameter order: parameter ``i``'s rows are spread over every rank's
shard. The engine's full buffer stays in parameter order (``ParamInfo.offset``, as in
:class:`~shardwrap.layout.flat.FlatLayout`), so the full views are unchanged; on gloo each
peer's pieces are copied from its message to their places there ([Note: placed
all-gathers] in ``core/chunk_copy.py``), elsewhere the gather lands in a separate buffer
and is copied out once, per parameter one concatenation of its ranks' pieces. Gradients go
the other way through the same pieces ([Note: packed gradients] in
``layout/grad_slots.py``, which reads :meth:`ChunkLayout.rank_pieces`).
With one shard (and no alignment) this is the flat layout exactly, and nothing is copied.

[Note: aligned full views]
The full buffer's order is free (only the shards travel), so each parameter may start at
a multiple of ``align_numel`` elements there. The FSDP2 door aligns them to 64 bytes, as
the CPU allocator aligns a tensor of its own: CPU kernels (MKL's matrix-vector product,
for one) round differently with the operand's alignment, so a full view at an odd
offset computes, bit for bit, not what torch's FSDP2 and single-process training compute
with their separately allocated parameters (a 1-row ``Linear`` showed it at step 2).

Everything here is a function of plain numbers, tested with hypothesis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .flat import ParamInfo, ShardPiece


def chunk_rows(num_rows: int, num_shards: int, shard_index: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of ``torch.chunk(t, num_shards, dim=0)[shard_index]`` for a
    tensor of ``num_rows`` rows (empty where the rows run out, as FSDP2 pads the list)."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
    rows_per_chunk = -(-num_rows // num_shards)
    start = min(shard_index * rows_per_chunk, num_rows)
    return start, min(start + rows_per_chunk, num_rows)


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, elements per row)`` of a parameter of ``shape`` (a scalar: one row of one)."""
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """A unit's parameters for ``num_shards`` shards of dim-0 chunks ([Note: the dim-0 chunk
    layout]). Offers what the engine reads of :class:`~shardwrap.layout.flat.FlatLayout`."""

    params: tuple[ParamInfo, ...]
    num_shards: int

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        end = 0
        for info in self.params:
            if info.offset < end:
                raise ValueError(f"parameter {info.fqn!r} starts at {info.offset}, before {end}")
            end = info.end

    @staticmethod
    def build(
        named: list[tuple[str, tuple[int, ...], bool]], num_shards: int, *, align_numel: int = 1
    ) -> ChunkLayout:
        """Lay out ``(fqn, shape, requires_grad)`` entries; in the full buffer each starts
        at a multiple of ``align_numel`` elements ([Note: aligned full views])."""
        if align_numel < 1:
            raise ValueError(f"align_numel must be >= 1, got {align_numel}")
        infos = []
        offset = 0
        for fqn, shape, requires_grad in named:
            info = ParamInfo(
                fqn, tuple(shape), -(-offset // align_numel) * align_numel, requires_grad
            )
            infos.append(info)
            offset = info.end
        return ChunkLayout(tuple(infos), num_shards)

    def with_prefix(self, prefix: str) -> ChunkLayout:
        """The same layout with ``prefix.`` in front of every parameter name."""
        renamed = tuple(replace(info, fqn=f"{prefix}.{info.fqn}") for info in self.params)
        return ChunkLayout(renamed, self.num_shards)

    @property
    def shards_are_contiguous(self) -> bool:
        """Whether shard ``r`` is the full buffer's ``r``-th slice (one shard, no gaps)."""
        return self.num_shards == 1 and self.unpadded_numel == sum(i.numel for i in self.params)

    def local_rows(self, index: int, shard_index: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of parameter ``index`` that shard ``shard_index`` holds."""
        num_rows, _ = rows_of(self.params[index].shape)
        return chunk_rows(num_rows, self.num_shards, shard_index)

    def local_shape(self, index: int, shard_index: int) -> tuple[int, ...]:
        """The local tensor's shape of parameter ``index`` on shard ``shard_index``."""
        start, end = self.local_rows(index, shard_index)
        return (end - start, *self.params[index].shape[1:])

    def pieces(self, shard_index: int) -> tuple[ShardPiece, ...]:
        """One piece per parameter (possibly empty) for ``shard_index``, end to end."""
        found = []
        position = 0
        for index, info in enumerate(self.params):
            start, end = self.local_rows(index, shard_index)
            _, row_numel = rows_of(info.shape)
            piece = ShardPiece(start * row_numel, end * row_numel, position)
            found.append(piece if piece.numel else ShardPiece(0, 0, 0))
            position += piece.numel
        return tuple(found)

    def rank_pieces(self, index: int) -> tuple[tuple[int, ShardPiece], ...]:
        """``(shard index, piece)`` of every shard that holds some of parameter ``index``,
        in shard order (their pieces then cover the parameter in element order)."""
        return tuple((rank, self.pieces(rank)[index]) for rank in self.owners(index))

    def reference_gaps(self, shard_index: int) -> tuple[tuple[int, int], ...]:
        """Where FSDP2's gradient reduce-scatter pads chunk ``shard_index`` and the packed
        one ([Note: packed gradients]) does not: FSDP2 pads every trainable parameter's
        chunk to shard 0's, the packed chunk only at its end. ``(offset, length)`` in
        FSDP2's chunk, for the sum order of [Note: gloo's sum order] in comm/sum_order.py."""
        gaps, offset = [], 0
        pieces = zip(self.params, self.pieces(0), self.pieces(shard_index), strict=True)
        for info, first, own in pieces:
            if info.requires_grad:
                if own.numel < first.numel:
                    gaps.append((offset + own.numel, first.numel - own.numel))
                offset += first.numel
        return tuple(gaps)

    def owners(self, param_index: int) -> tuple[int, ...]:
        """Shard indices that hold at least one element of parameter ``param_index``."""
        if self.params[param_index].numel == 0:
            return ()
        return tuple(
            rank
            for rank in range(self.num_shards)
            if self.local_rows(param_index, rank)[1] > self.local_rows(param_index, rank)[0]
        )

    @property
    def unpadded_numel(self) -> int:
        """The full buffer's extent: the last parameter's end (alignment gaps included)."""
        return self.params[-1].end if self.params else 0

    @property
    def shard_numel(self) -> int:
        """Elements of every shard: the longest rank's chunks (shard 0's)."""
        return sum(piece.numel for piece in self.pieces(0))

    @property
    def gathered_numel(self) -> int:
        """Elements the all-gather fills: ``num_shards`` shards, in rank order."""
        return self.num_shards * self.shard_numel

    @property
    def padded_numel(self) -> int:
        """Elements of the full buffer: it holds every parameter, and as many as the
        gathered shards (so a one-shard unit's full buffer is its shard)."""
        return max(self.gathered_numel, self.unpadded_numel)

    @property
    def num_padding(self) -> int:
        return self.padded_numel - self.unpadded_numel

    def shard_range(self, shard_index: int) -> tuple[int, int]:
        """Shard ``shard_index``'s range of the full buffer: only with one shard."""
        if not self.shards_are_contiguous:
            raise ValueError(
                "shard_range: a dim-0 chunk layout's shards are not ranges of the full "
                "buffer (see [Note: the dim-0 chunk layout]); use pieces()"
            )
        return 0, self.padded_numel
