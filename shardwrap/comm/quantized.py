"""All-gather and reduce-scatter that move block-quantized values (ZeRO++'s qwZ and qgZ).

[Note: quantized collectives]
Both take the same tensors as the Communicator's plain collectives and, with a codec,
move ``uint8`` wire rows instead ([Note: block quantization] in base/quantize.py):

* all-gather (qwZ): this rank quantizes its shard into one row; the rows of all ranks
  are all-gathered; the wait dequantizes each rank's row into its slice of the output,
  in the output's dtype. Every rank dequantizes the same bytes, so every rank (this one
  too, for its own slice) computes with the same values.
* reduce-scatter (qgZ): slice r of the input (rank r's part of the sum) is quantized into
  row r, and an all-to-all hands each rank the rows meant for it. The wait dequantizes
  them into fp32, puts this rank's own slice in unquantized, and sums in rank order in
  fp32: each contribution is quantized once, and nothing quantized is ever added to.
* all-reduce (qgZ's second level, across the replica groups of a hybrid strategy): each
  rank's reduced shard is quantized once and all-gathered; every rank sums all rows in
  rank order in fp32, its own as sent, so the replicas keep identical shards.

The ledger records each as the collective it is (``all_gather``, ``all_to_all``) with its
real ``uint8`` bytes, and, in ``unquantized_bytes``, the bytes the plain collective would
have moved, so a profile shows what was saved. A group of one rank moves nothing and
quantizes nothing: it takes the plain path.
"""

from __future__ import annotations

import torch

from ..base.quantize import BlockCodec, dequantize, quantize


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_gather(comm, out_full, in_shard, *, purpose: str, unit: str, codec: BlockCodec | None):
    """``comm.all_gather(out_full, in_shard)``, quantized with ``codec`` (None: plain)."""
    if codec is None or comm.size == 1:
        return comm.all_gather(out_full, in_shard, purpose=purpose, unit=unit)
    numel = in_shard.numel()
    row = quantize(in_shard.reshape(-1), codec)
    rows = torch.empty((comm.size, row.numel()), dtype=torch.uint8, device=row.device)
    work = comm.all_gather(
        rows.view(-1), row, purpose=purpose, unit=unit, unquantized_bytes=_nbytes(out_full)
    )
    return _Dequantized(work, rows, out_full, numel, codec)


def reduce_scatter(comm, out_shard, in_full, *, purpose: str, unit: str, codec: BlockCodec | None):
    """``comm.reduce_scatter(out_shard, in_full)``, quantized with ``codec`` (None: plain).

    ``in_full`` must stay unchanged until the wait (this rank's slice is read then)."""
    if codec is None or comm.size == 1:
        return comm.reduce_scatter(out_shard, in_full, purpose=purpose, unit=unit)
    slices = in_full.view(comm.size, -1)
    numel = slices.shape[1]
    rows = torch.empty(
        (comm.size, codec.row_bytes(numel)), dtype=torch.uint8, device=in_full.device
    )
    for peer in range(comm.size):  # row r: rank r's part; this rank's own is never read
        if peer != comm.rank:
            quantize(slices[peer], codec, out=rows[peer])
    received = torch.empty_like(rows)
    work = comm.all_to_all(
        received.view(-1),
        rows.view(-1),
        purpose=purpose,
        unit=unit,
        unquantized_bytes=_nbytes(in_full),
    )
    return _Summed(work, received, slices[comm.rank], out_shard, codec, comm.rank)


def all_reduce(comm, tensor, *, purpose: str, unit: str, codec: BlockCodec | None):
    """``comm.all_reduce(tensor)`` (a sum, in place), quantized with ``codec`` (None: plain).

    Every rank all-gathers every rank's quantized row and sums the dequantized rows in
    rank order in fp32, its own row included as sent: every rank ends with the same bits.
    """
    if codec is None or comm.size == 1:
        return comm.all_reduce(tensor, purpose=purpose, unit=unit)
    row = quantize(tensor.reshape(-1), codec)
    rows = torch.empty((comm.size, row.numel()), dtype=torch.uint8, device=row.device)
    plain = comm.size * _nbytes(tensor)  # the same all-gather unquantized
    work = comm.all_gather(rows.view(-1), row, purpose=purpose, unit=unit, unquantized_bytes=plain)
    return _Summed(work, rows, None, tensor, codec, comm.rank)


class _Dequantized:
    """A quantized all-gather in flight; its wait writes the values into the output."""

    def __init__(self, work, rows, out_full, numel: int, codec: BlockCodec) -> None:
        self._work = work
        self._rows = rows  # (ranks, row bytes) uint8, filled by the collective
        self._out = out_full
        self._numel = numel
        self._codec = codec

    def wait(self) -> bool:
        if self._work is None:
            return True
        self._work.wait()
        with torch.no_grad():  # straight into the output, rank r's row into slice r
            out = self._out.view(self._rows.shape[0], -1)
            dequantize(self._rows, self._numel, self._codec, out=out)
        self._work = self._rows = self._out = None
        return True


class _Summed:
    """A quantized reduce-scatter in flight; its wait sums the received parts in fp32."""

    def __init__(self, work, received, own, out_shard, codec: BlockCodec, rank: int) -> None:
        self._work = work
        self._received = received  # (ranks, row bytes) uint8: row r from rank r
        self._own = own  # this rank's unquantized part (None: use the row it sent)
        self._out = out_shard
        self._codec = codec
        self._rank = rank

    def wait(self) -> bool:
        if self._work is None:
            return True
        self._work.wait()
        with torch.no_grad():
            self._sum()
        self._work = self._received = self._own = self._out = None
        return True

    def _sum(self) -> None:
        """The parts added in rank order into an fp32 sum, one at a time (the order and
        the fp32 adds of summing the stacked parts), each dequantized when its turn comes;
        this rank's own part of a reduce-scatter is taken unquantized."""
        out = self._out.view(-1)
        own = None if self._own is None else self._own.reshape(-1)
        in_place = out.dtype == torch.float32 and (own is None or not _overlap(out, own))
        total = out if in_place else torch.empty(out.numel(), device=out.device)
        scratch = None
        for r in range(self._received.shape[0]):
            if r == self._rank and own is not None:
                part = own
            else:
                target = total if r == 0 else scratch
                if target is None:
                    target = scratch = torch.empty_like(total)
                part = dequantize(self._received[r], out.numel(), self._codec, out=target)
            if r == 0:
                if part is not total:
                    total.copy_(part)
            else:
                total.add_(part)
        if not in_place:
            out.copy_(total)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share storage (then ``a`` cannot hold a sum that reads ``b``)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
