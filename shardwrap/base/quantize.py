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
any tensor, with torch ops only (no loop over blocks), the same code on CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .validate import check_int

SUPPORTED_BITS = (8, 4)
_SCALE_BYTES = 4  # fp32
_INT4_OFFSET = 8  # int4 values -7..7 stored as 1..15 in a nibble


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


def quantize(x: torch.Tensor, codec: BlockCodec) -> torch.Tensor:
    """``x``'s last dimension as wire rows: ``(..., codec.row_bytes(n))`` uint8."""
    q, scales = quantize_blocks(x, codec)
    # the last block's padding is not sent
    q = q.flatten(-2)[..., : codec._values_sent(x.shape[-1])]
    if codec.bits == 8:
        value_bytes = q.view(torch.uint8)
    else:
        nibbles = (q + _INT4_OFFSET).to(torch.uint8)
        value_bytes = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    scale_bytes = scales.contiguous().view(torch.uint8)
    return torch.cat([value_bytes, scale_bytes], dim=-1)


def dequantize(
    rows: torch.Tensor, numel: int, codec: BlockCodec, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Wire rows from :func:`quantize` of ``numel`` values back to ``(..., numel)`` values."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != codec.row_bytes(numel):
        raise ValueError(
            f"rows: expected uint8 rows of {codec.row_bytes(numel)} bytes for {numel} values, "
            f"got {tuple(rows.shape)} {rows.dtype}"
        )
    lead = rows.shape[:-1]
    split = codec._value_bytes(numel)
    value_bytes = rows[..., :split]
    blocks = codec.num_blocks(numel)
    # copied into a fresh buffer, aligned for fp32
    scales = rows[..., split:].flatten().clone().view(torch.float32).reshape(*lead, blocks)
    if codec.bits == 8:
        q = value_bytes.view(torch.int8)
    else:
        low = (value_bytes & 0xF).to(torch.int8)
        high = (value_bytes >> 4).to(torch.int8)
        q = torch.stack([low, high], dim=-1).reshape(*lead, 2 * split) - _INT4_OFFSET
    q = F.pad(q, (0, blocks * codec.block_size - q.shape[-1]))  # the last block's padding
    q = q.reshape(*lead, blocks, codec.block_size)
    return dequantize_blocks(q, scales, numel, dtype)
