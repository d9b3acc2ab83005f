"""All-gather, reduce-scatter and all-reduce that move block-quantized values (qwZ, qgZ).

[Note: quantized collectives]
Each takes the same tensors as the Communicator's plain collective and, with a codec,
moves ``uint8`` wire rows instead ([Note: block quantization] in base/quantize.py):

* all-gather (qwZ): this rank quantizes its shard into one row; the rows of all ranks
  are all-gathered; the wait dequantizes each rank's row into its slice of the output,
  in the output's dtype. Every rank dequantizes the same bytes, so every rank (this one
  too, for its own slice) computes with the same values.
* reduce-scatter (qgZ): slice r of the input (rank r's part of the sum) is quantized into
  row r, and an all-to-all hands each rank the rows meant for it. The wait dequantizes
  them into fp32, puts this rank's own slice in unquantized, and sums in rank order in
  fp32: each contribution is quantized once, and nothing quantized is ever added to.
* all-reduce (qgZ's second level, across the replica groups of a hybrid strategy):
  [Note: quantized all-reduce] below.

The ledger records each as the collective it is (``all_gather``, ``all_to_all``) with its
real ``uint8`` bytes, and, in ``unquantized_bytes``, the bytes the plain collective would
have moved, so a profile shows what was saved. A group of one rank moves nothing and
quantizes nothing: it takes the plain path.

[Note: quantized all-reduce]
Gathering every replica's quantized row would cost each rank ``(R-1) n`` bytes (int8) for
``n`` values over ``R`` replicas, against ``8 n (R-1) / R`` for an fp32 ring all-reduce:
no saving from ``R = 8`` on. So the sum runs as a ring all-reduce does, in two passes,
each on slices of ``ceil(n / R)`` values (the tensor padded with zeros to ``R`` of them):

1. a quantized reduce-scatter (the all-to-all above): slice ``r`` of every replica's
   tensor goes to replica ``r``, which sums the ``R`` contributions in rank order in
   fp32, its own unquantized;
2. a quantized all-gather of the summed slices: each replica quantizes its fp32 sum
   once, and every replica dequantizes every row, its own included, so all replicas
   end with the same bits.

Each rank receives ``2 (R-1)`` rows of ``ceil(n / R)`` values: about ``2 n (R-1) / R``
bytes for int8 plus one scale per block, the fp32 all-reduce's bytes at a quarter (an
eighth for int4). Each pass is recorded with ``unquantized_bytes`` of the tensor's own
bytes: one ring pass of the plain all-reduce each, so the two together say what the
plain all-reduce (``kind == "all_reduce"``, twice its bytes on the wire) would have
moved. The all-gather is issued by the wait, when the sum it gathers exists.
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
    return _gather(comm, out_full, in_shard, purpose, unit, codec, _nbytes(out_full))


def _gather(comm, out_full, in_shard, purpose: str, unit: str, codec: BlockCodec, plain: int):
    """The quantized all-gather, recorded as saving against ``plain`` bytes."""
    numel = in_shard.numel()
    row = quantize(in_shard.reshape(-1), codec)
    rows = torch.empty((comm.size, row.numel()), dtype=torch.uint8, device=row.device)
    work = comm.all_gather(rows.view(-1), row, purpose=purpose, unit=unit, unquantized_bytes=plain)
    return _Dequantized(work, rows, out_full, numel, codec)


def reduce_scatter(
    comm, out_shard, in_full, *, purpose: str, unit: str, codec: BlockCodec | None, slices=None
):
    """``comm.reduce_scatter(out_shard, in_full)``, quantized with ``codec`` (None: plain;
    ``slices``, its ``peer_slices``, for a plain one).

    ``in_full`` must stay unchanged until the wait (this rank's slice is read then)."""
    if codec is None or comm.size == 1:
        return comm.reduce_scatter(
            out_shard, in_full, purpose=purpose, unit=unit, peer_slices=slices
        )
    return _scatter(comm, out_shard, in_full, purpose, unit, codec, _nbytes(in_full))


def _scatter(comm, out_shard, in_full, purpose: str, unit: str, codec: BlockCodec, plain: int):
    """The quantized reduce-scatter (an all-to-all), recorded as saving against ``plain``."""
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
        received.view(-1), rows.view(-1), purpose=purpose, unit=unit, unquantized_bytes=plain
    )
    return _Summed(work, received, slices[comm.rank], out_shard, codec, comm.rank)


def all_reduce(comm, tensor, *, purpose: str, unit: str, codec: BlockCodec | None):
    """``comm.all_reduce(tensor)`` (a sum, in place), quantized with ``codec`` (None: plain).

    A quantized reduce-scatter of slices, then a quantized all-gather of the summed
    slices ([Note: quantized all-reduce]): every rank ends with the same bits. ``tensor``
    (contiguous) must stay unchanged until the wait, which issues the all-gather.
    """
    if codec is None or comm.size == 1:
        return comm.all_reduce(tensor, purpose=purpose, unit=unit)
    flat = tensor.view(-1)
    slice_numel = -(-flat.numel() // comm.size)
    padded = flat
    if slice_numel * comm.size != flat.numel():  # zeros to R whole slices
        padded = torch.zeros(slice_numel * comm.size, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()].copy_(flat)
    summed = torch.empty(slice_numel, dtype=torch.float32, device=flat.device)  # this slice
    plain = _nbytes(tensor)  # one ring pass of the plain all-reduce
    work = _scatter(comm, summed, padded, purpose, unit, codec, plain)
    return _ScatteredThenGathered(work, comm, flat, padded, summed, (purpose, unit, codec, plain))


class _ScatteredThenGathered:
    """A quantized all-reduce in flight: its wait ends the reduce-scatter, then gathers."""

    def __init__(self, work, comm, flat, padded, summed, gather_args: tuple) -> None:
        self._work = work  # the reduce-scatter's _Summed, writing into summed
        self._comm = comm
        self._flat = flat  # the caller's tensor, 1D
        self._padded = padded  # flat, or a zero-padded copy: R slices of summed's length
        self._summed = summed  # 1D fp32: this rank's slice of the sum
        self._gather_args = gather_args  # purpose, unit, codec, plain bytes

    def wait(self) -> bool:
        if self._work is None:
            return True
        self._work.wait()
        _gather(self._comm, self._padded, self._summed, *self._gather_args).wait()
        if self._padded is not self._flat:
            self._flat.copy_(self._padded[: self._flat.numel()])
        self._work = self._comm = self._flat = self._padded = self._summed = None
        return True


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
        self._own = own  # this rank's unquantized part (its row in received is unused)
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
        this rank's own part is taken unquantized."""
        out = self._out.view(-1)
        own = self._own.reshape(-1)
        in_place = out.dtype == torch.float32 and not _overlap(out, own)
        total = out if in_place else torch.empty(out.numel(), device=out.device)
        scratch = None
        for r in range(self._received.shape[0]):
            if r == self._rank:
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
