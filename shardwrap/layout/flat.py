"""Pure shard arithmetic: where each original parameter sits in a unit's flat buffer.

Everything here is a function of plain numbers. No tensors, no process group, so it is
unit-tested exhaustively (hypothesis) without spawning ranks.

A unit's parameters are laid end to end in a 1-D *flat* buffer in registration order,
then the buffer is padded at its end to a multiple of the number of shards. Shard ``r``
owns the contiguous element range ``[r * shard_numel, (r + 1) * shard_numel)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """Metadata of one original parameter, recorded once at wrap time."""

    fqn: str  # name relative to the wrapped root, e.g. "blocks.0.attn.weight"
    shape: tuple[int, ...]
    offset: int  # first element in the unit's unpadded flat buffer
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """The part of one parameter that a shard owns.

    ``param_start``/``param_end`` index the parameter's flattened elements;
    ``shard_start`` is where that part begins inside the shard. An empty piece
    (``param_start == param_end``) means the shard holds none of the parameter.
    """

    param_start: int
    param_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.numel


def padded_numel(unpadded_numel: int, num_shards: int) -> int:
    """Smallest multiple of ``num_shards`` that holds ``unpadded_numel`` elements."""
    if unpadded_numel < 0:
        raise ValueError(f"unpadded_numel must be >= 0, got {unpadded_numel}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return -(-unpadded_numel // num_shards) * num_shards


def shard_range(unpadded_numel: int, num_shards: int, shard_index: int) -> tuple[int, int]:
    """Flat element range ``[start, end)`` owned by ``shard_index`` (may include padding)."""
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
    shard_numel = padded_numel(unpadded_numel, num_shards) // num_shards
    return shard_index * shard_numel, (shard_index + 1) * shard_numel


def piece_of(info: ParamInfo, start: int, end: int) -> ShardPiece:
    """The part of ``info`` that lies in the flat range ``[start, end)``."""
    lo = max(info.offset, start)
    hi = min(info.end, end)
    if hi <= lo:
        return ShardPiece(0, 0, 0)
    return ShardPiece(lo - info.offset, hi - info.offset, lo - start)


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Layout of one unit's parameters in its flat buffer, for a given number of shards."""

    params: tuple[ParamInfo, ...]
    num_shards: int

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        expected = 0
        for info in self.params:
            if info.offset != expected:
                raise ValueError(f"parameter {info.fqn!r} starts at {info.offset}, not {expected}")
            expected = info.end

    @staticmethod
    def build(named: list[tuple[str, tuple[int, ...], bool]], num_shards: int) -> FlatLayout:
        """Lay out ``(fqn, shape, requires_grad)`` entries end to end."""
        infos = []
        offset = 0
        for fqn, shape, requires_grad in named:
            info = ParamInfo(fqn, tuple(shape), offset, requires_grad)
            infos.append(info)
            offset = info.end
        return FlatLayout(tuple(infos), num_shards)

    def with_prefix(self, prefix: str) -> FlatLayout:
        """The same layout with ``prefix.`` in front of every parameter name."""
        renamed = tuple(replace(info, fqn=f"{prefix}.{info.fqn}") for info in self.params)
        return FlatLayout(renamed, self.num_shards)

    @property
    def unpadded_numel(self) -> int:
        return self.params[-1].end if self.params else 0

    @property
    def padded_numel(self) -> int:
        return padded_numel(self.unpadded_numel, self.num_shards)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    @property
    def num_padding(self) -> int:
        return self.padded_numel - self.unpadded_numel

    def shard_range(self, shard_index: int) -> tuple[int, int]:
        return shard_range(self.unpadded_numel, self.num_shards, shard_index)

    def pieces(self, shard_index: int) -> tuple[ShardPiece, ...]:
        """One piece per parameter (possibly empty) for ``shard_index``."""
        start, end = self.shard_range(shard_index)
        return tuple(piece_of(info, start, end) for info in self.params)

    @property
    def shards_are_contiguous(self) -> bool:
        """Shard ``r`` is the full buffer's ``r``-th slice (the dim-0 chunk layout's are not:
        ``layout/chunks.py``)."""
        return True

    def rank_pieces(self, index: int) -> tuple[tuple[int, ShardPiece], ...]:
        """``(shard index, piece)`` of every shard that holds some of parameter ``index``."""
        info = self.params[index]
        return tuple((rank, piece_of(info, *self.shard_range(rank))) for rank in self.owners(index))

    def owners(self, param_index: int) -> tuple[int, ...]:
        """Shard indices that hold at least one element of parameter ``param_index``."""
        info = self.params[param_index]
        if info.numel == 0:
            return ()
        size = self.shard_numel
        return tuple(range(info.offset // size, (info.end - 1) // size + 1))
