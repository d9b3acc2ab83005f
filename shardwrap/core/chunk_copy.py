"""Copies between a unit's full buffer (parameter order) and shards that are not its slices.

Under the dim-0 chunk layout ([Note: the dim-0 chunk layout] in ``layout/chunks.py``) rank
``r``'s shard holds every parameter's chunk ``r`` end to end, so neither the shard nor the
gathered shards are ranges of the full buffer the full views live in. These
functions move the elements between the orders; with a layout whose shards are slices
(:class:`~shardwrap.layout.flat.FlatLayout`) the shard is a slice and the gather lands in
place.

[Note: placed all-gathers]
On gloo the all-gather is pairwise sends anyway ([Note: pairwise collectives on gloo]), so
a chunk layout's gather need not land in rank order: each rank sends every peer its
shard's pieces as one message (they lie end to end from the shard's start; the padding
after them is not sent), each peer's lands in a buffer of its own, and at the wait its
pieces are copied to their places in the full buffer (this rank's own straight from its
shard). One copy of the gathered elements, where landing in rank order copied this rank's
shard into a buffer of every rank's, then everything out of it (one concatenation per
parameter). A message per piece, tried first, spared the
copy but cost more than it (about 1 ms a gather at 5m: gloo's per-message work). Ranks
whose chunks are short send less than the ring share; the ledger records what each sent
(``CommRecord.sent_bytes``). Elsewhere (NCCL) the gather lands in rank order and
:func:`copy_out` follows.
"""

from __future__ import annotations

import functools

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


def gather_full(comm, layout, flat_full: torch.Tensor, shard: torch.Tensor, *, unit: str):
    """Issue the plain all-gather of ``layout``'s shards for ``flat_full``: its waitable,
    and the landing buffer :func:`copy_out` empties after the wait (None: none)."""
    if not layout.shards_are_contiguous and comm.places_pieces(flat_full):
        places = gather_places(layout)  # [Note: placed all-gathers]
        numel = layout.gathered_numel
        work = comm.all_gather_placed(
            flat_full, shard, places, gathered_numel=numel, purpose="params", unit=unit
        )
        return work, None
    landing = landing_for(layout, flat_full)
    target = flat_full if landing is None else landing
    return comm.all_gather(target, shard, purpose="params", unit=unit), landing


@functools.lru_cache(maxsize=1024)
def gather_places(layout: ChunkLayout) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """For each rank, its shard's non-empty pieces as ``(shard_start, shard_end,
    full_start)``: where a placed all-gather puts them ([Note: placed all-gathers])."""
    return tuple(
        tuple(
            (piece.shard_start, piece.shard_end, info.offset + piece.param_start)
            for info, piece in zip(layout.params, layout.pieces(rank), strict=True)
            if piece.numel
        )
        for rank in range(layout.num_shards)
    )


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
