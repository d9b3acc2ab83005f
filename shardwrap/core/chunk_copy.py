"""Copies between a unit's full buffer (parameter order) and shards that are not its slices.

Under the dim-0 chunk layout ([Note: the dim-0 chunk layout] in ``layout/chunks.py``) rank
``r``'s shard holds every parameter's chunk ``r`` end to end, so neither the shard nor the
gathered shards are ranges of the full buffer the full views live in. These two
functions move the elements between the orders; with a layout whose shards are slices
(:class:`~shardwrap.layout.flat.FlatLayout`) the shard is a slice and the gather lands in
place.
"""

from __future__ import annotations

import torch

from ..layout.chunks import ChunkLayout
from ..layout.flat import FlatLayout


def take_shard(
    layout: FlatLayout | ChunkLayout, flat_full: torch.Tensor, rank: int
) -> torch.Tensor:
    """Rank ``rank``'s shard (1D, ``shard_numel``, a copy) of ``flat_full`` (parameter
    order, padded); a chunk layout's padding is zeros."""
    if layout.shards_are_contiguous:
        start, end = layout.shard_range(rank)
        return flat_full[start:end].clone()
    shard = flat_full.new_zeros(layout.shard_numel)
    for info, piece in zip(layout.params, layout.pieces(rank), strict=True):
        if piece.numel:
            start = info.offset + piece.param_start
            shard[piece.shard_start : piece.shard_end].copy_(flat_full[start : start + piece.numel])
    return shard


@torch.no_grad()
def copy_out(layout: ChunkLayout, gathered: torch.Tensor, flat_full: torch.Tensor) -> None:
    """Write the all-gathered shards (``num_shards * shard_numel``, rank order) into
    ``flat_full`` (parameter order): one concatenation of its ranks' pieces per parameter."""
    by_rank = gathered.view(layout.num_shards, layout.shard_numel)
    pieces_by_rank = [layout.pieces(rank) for rank in range(layout.num_shards)]
    for index, info in enumerate(layout.params):
        parts = [
            by_rank[rank, p.shard_start : p.shard_end]
            for rank in range(layout.num_shards)
            if (p := pieces_by_rank[rank][index]).numel
        ]
        if parts:
            torch.cat(parts, out=flat_full[info.offset : info.end])


def landing_for(layout: FlatLayout | ChunkLayout, flat_full: torch.Tensor) -> torch.Tensor | None:
    """Where an all-gather of ``layout``'s shards lands: ``None`` when the shards are
    slices of ``flat_full`` (they land in place), else a separate 1D buffer of
    ``gathered_numel`` elements that :func:`copy_out` empties into ``flat_full``."""
    if layout.shards_are_contiguous:
        return None
    return flat_full.new_empty(layout.gathered_numel)  # type: ignore[union-attr]


def place_gathered(
    layout: FlatLayout | ChunkLayout, full_by_rank: torch.Tensor, flat_full: torch.Tensor
) -> None:
    """Write a fused all-gather's result (``(num_shards, shard_numel)``, rank r's shard in
    row r) into ``flat_full`` in parameter order."""
    if layout.shards_are_contiguous:
        flat_full.view(layout.num_shards, -1).copy_(full_by_rank)
    else:
        copy_out(layout, full_by_rank.contiguous(), flat_full)  # type: ignore[arg-type]
