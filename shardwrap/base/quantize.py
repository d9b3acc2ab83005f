"""Symmetric block quantization of 1-D rows, and the byte rows that carry it over the wire.

[Note: block quantization]
A row of ``n`` values is cut into blocks of ``block_size`` elements (the last block padded
with zeros). Each block has one fp32 scale ``s = max|x| / qmax`` (``qmax`` = 127 for int8,
7 for int4) and integers ``q = round(x / s)`` in ``[-qmax, qmax]``; its values come back
as ``q * s``. Rounding to the nearest integer leaves each value within ``s / 2`` of the
original (plus fp32 rounding of the division and product, a few ulps of the block's
largest value). A block of zeros has scale 0 and comes back as zeros.

On the wire a row is one ``uint8`` row: the ``n`` integers (one byte each for int8; two to
a byte for int4, low nibble first, stored as ``q + 8``; the last block's padding is not
sent), then the scales' fp32 bytes. One
collective thus moves integers and scales together, and every rank can cut a received
row apart knowing only ``n`` and the codec. The functions work on the last dimension of
any tensor, with torch ops only (no loop over blocks), the same code on CPU and CUDA. (Int4
packing views byte pairs as int16, so it assumes a little-endian machine, as x86, ARM and
every CUDA device are.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .validate import check_int

SUPPORTED_BITS = (8, 4)
_SCALE_BYTES = 4  # fp32
_INT4_OFFSET = 8  # int4 values -7..7 stored as 1..15 in a nibble
# Blocks worked on at a time: 1024 blocks of 256 fp32 values (1 MiB) keep each step's
# temporaries in cache and out of fresh allocations (a 15M-value row quantized whole
# took 9x longer on the benchmark machine); every op is per value or per block, so the
# results do not depend on it.
_CHUNK_VALUES = 1 << 18


@dataclass(frozen=True, slots=True)
class BlockCodec:
    """How rows are quantized: ``bits`` per value (8 or 4), one scale per ``block_size``."""

    bits: int = 8
    block_size: int = 256

    def __post_init__(self) -> None:
        if type(self.bits) is not int or self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits: expected one of {SUPPORTED_BITS}, got {self.bits!r}")
        check_int("block_size", self.block_size, minimum=2)
        if self.block_size % 2:
            raise ValueError(
                f"block_size: must be even (int4 packs two values to a byte), got {self.block_size}"
            )

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def _values_sent(self, numel: int) -> int:
        """Integers a row carries: ``numel``, one more for int4 when odd (whole bytes)."""
        return numel + numel % 2 if self.bits == 4 else numel

    def _value_bytes(self, numel: int) -> int:
        return self._values_sent(numel) * self.bits // 8

    def row_bytes(self, numel: int) -> int:
        """Bytes of the wire row of ``numel`` values: integers, then scales."""
        return self._value_bytes(numel) + self.num_blocks(numel) * _SCALE_BYTES


def quantize_blocks(x: torch.Tensor, codec: BlockCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` of ``x``'s last dimension: q ``(..., blocks, block_size)`` int8 in
    ``[-qmax, qmax]``, scales ``(..., blocks)`` fp32 ([Note: block quantization])."""
    numel = x.shape[-1]
    padded = codec.num_blocks(numel) * codec.block_size
    values = x.detach().float()
    if padded != numel:
        values = F.pad(values, (0, padded - numel))
    blocks = values.reshape(*x.shape[:-1], padded // codec.block_size, codec.block_size)
    scales = blocks.abs().amax(dim=-1) / codec.qmax
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    q = torch.round(blocks / divisor).clamp_(-codec.qmax, codec.qmax).to(torch.int8)
    return q, scales


def dequantize_blocks(
    q: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values ``q * scales`` as ``(..., numel)`` in ``dtype`` (padding dropped)."""
    values = q.float() * scales.unsqueeze(-1)
    return values.flatten(-2)[..., :numel].to(dtype)


def _parts(t: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """Views of ``t``'s last dimension as ``(..., blocks, block_size)``: the whole blocks,
    then the partial last block (``(..., 1, rest)``) if any; no copy."""
    numel = t.shape[-1]
    whole = numel - numel % block_size
    parts = [t[..., :whole].unflatten(-1, (whole // block_size, block_size))] if whole else []
    if whole < numel:
        parts.append(t[..., whole:].unsqueeze(-2))
    return parts


def _chunked(blocks: torch.Tensor, *others: torch.Tensor):
    """``(blocks, *others)`` cut along the blocks dimension (-2 of ``blocks``, ``-2`` or
    ``-1`` of the others, as their ranks say) into pieces of about ``_CHUNK_VALUES``."""
    step = max(1, _CHUNK_VALUES // blocks.shape[-1])
    for start in range(0, blocks.shape[-2], step):
        piece = slice(start, start + step)
        yield tuple(
            t[..., piece, :] if t.dim() == blocks.dim() else t[..., piece]
            for t in (blocks, *others)
        )


def _quantize_into(blocks: torch.Tensor, scales: torch.Tensor, q: torch.Tensor, qmax: int) -> None:
    """:func:`quantize_blocks`'s arithmetic, written into ``scales`` and ``q`` (views)."""
    for piece in _chunked(blocks, scales, q):
        _quantize_piece(*piece, qmax)


def _quantize_piece(blocks: torch.Tensor, scales: torch.Tensor, q: torch.Tensor, qmax: int):
    scales.copy_(blocks.abs().amax(dim=-1).div_(qmax))  # (vector_norm(inf) is slower on CPU)
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(-1)
    q.copy_(torch.div(blocks, divisor).round_().clamp_(-qmax, qmax))


def quantize(x: torch.Tensor, codec: BlockCodec, *, out: torch.Tensor | None = None):
    """``x``'s last dimension as wire rows: ``(..., codec.row_bytes(n))`` uint8 (into
    ``out``, of that shape, when given).

    The same integers and scales as :func:`quantize_blocks`, without padding ``x``: whole
    blocks and the partial last one are quantized where they lie.
    """
    values = x.detach()
    if values.dtype != torch.float32:
        values = values.float()
    numel, lead = values.shape[-1], values.shape[:-1]
    rows = out
    if rows is None:
        rows = torch.empty(*lead, codec.row_bytes(numel), dtype=torch.uint8, device=values.device)
    value_bytes = codec._value_bytes(numel)
    if codec.bits == 8:  # the integers go straight into the rows
        q = rows[..., :numel].view(torch.int8)
    else:
        q = torch.zeros(*lead, codec._values_sent(numel), dtype=torch.int8, device=values.device)
    scales = torch.empty(*lead, codec.num_blocks(numel), dtype=torch.float32, device=values.device)
    # one scale per part's block: the whole blocks' scales, then the partial block's
    scale_parts = scales.split([p.shape[-2] for p in _parts(values, codec.block_size)], dim=-1)
    for blocks, scale, q_part in zip(
        _parts(values, codec.block_size),
        scale_parts,
        _parts(q[..., :numel], codec.block_size),
        strict=True,
    ):
        _quantize_into(blocks, scale, q_part, codec.qmax)
    if codec.bits == 4:  # each pair of bytes (lo, hi) as one int16 becomes lo | hi << 4
        pairs = q.add_(_INT4_OFFSET).view(torch.int16)
        rows[..., :value_bytes].copy_((pairs & 0xF) | ((pairs >> 4) & 0xF0))
    rows[..., value_bytes:].copy_(scales.view(torch.uint8))
    return rows


def dequantize(
    rows: torch.Tensor,
    numel: int,
    codec: BlockCodec,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Wire rows from :func:`quantize` of ``numel`` values back to ``(..., numel)`` values
    (into ``out``, of that shape, when given)."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != codec.row_bytes(numel):
        raise ValueError(
            f"rows: expected uint8 rows of {codec.row_bytes(numel)} bytes for {numel} values, "
            f"got {tuple(rows.shape)} {rows.dtype}"
        )
    lead = rows.shape[:-1]
    split = codec._value_bytes(numel)
    value_bytes = rows[..., :split]
    # copied into a fresh buffer, aligned for fp32
    scales = rows[..., split:].flatten().clone().view(torch.float32)
    scales = scales.reshape(*lead, codec.num_blocks(numel))
    if codec.bits == 8:
        q = value_bytes.view(torch.int8)
    else:
        wide = value_bytes.to(torch.int16)  # byte b -> (b & 0xF, b >> 4) as an int16's bytes
        pairs = (wide & 0xF) | ((wide << 4) & 0xF00)
        q = pairs.view(torch.int8).sub_(_INT4_OFFSET)
    if out is None:
        out = torch.empty(*lead, numel, dtype=dtype, device=rows.device)
    q_parts = _parts(q[..., :numel], codec.block_size)
    scale_parts = scales.split([p.shape[-2] for p in q_parts], dim=-1)
    for q_part, scale, out_part in zip(
        q_parts, scale_parts, _parts(out, codec.block_size), strict=True
    ):
        for q_piece, scale_piece, out_piece in _chunked(q_part, scale, out_part):
            # q * s: the integers convert exactly, then one multiply in fp32 (or wider)
            out_piece.copy_(q_piece).mul_(scale_piece.unsqueeze(-1))
    return out
