"""Hierarchical qgZ: the bytes each rank receives across R replica groups, R = 2..16.

    PYTHONPATH=$PWD python benchmarks/bench_qgz_hierarchical.py --numel 1000000

One process plays rank 0 of R replicas through torch's fake process group
(``backend="fake"``: collectives return at once, moving nothing) and runs qgZ's
across-replica sum, ``shardwrap.comm.quantized.all_reduce``, on ``--numel`` fp32 values
([Note: quantized all-reduce]). What it receives is counted twice: from the ledger
(``CommRecord.wire_bytes``) and from the tensors handed to ``torch.distributed`` (each
collective's output less this rank's own slice, :class:`ReceivedCounter`). Printed next to

* the fp32 ring all-reduce: ``2 (R-1)`` chunks of ``ceil(n / R)`` fp32 values
  (``8 n (R-1) / R`` when R divides n);
* the target, that all-reduce's quantized share: ``2 (R-1)`` chunks of ``ceil(n / R)``
  quantized values, each with one fp32 scale per block;
* the design it replaced, every replica's quantized row all-gathered: ``(R-1)`` rows of
  ``n`` values (:func:`gather_every_row`).

Timing means nothing here (nothing moves); only bytes are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardwrap.base.quantize import BlockCodec  # noqa: E402
from shardwrap.comm import quantized  # noqa: E402
from shardwrap.comm.collectives import CommLedger, Communicator  # noqa: E402

FP32_BYTES = 4
SCALE_BYTES = 4  # one fp32 scale per block


@contextlib.contextmanager
def fake_ranks(world_size: int, rank: int = 0):
    """This process as ``rank`` of ``world_size`` through torch's fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _group_size(kwargs) -> int:
    group = kwargs.get("group")
    return dist.get_world_size() if group is None else group.size()


class ReceivedCounter:
    """Bytes this rank receives in all-to-alls and all-gathers issued while installed:
    each output tensor less this rank's own slice of it (the other ranks' parts)."""

    def __init__(self) -> None:
        self.received = 0
        self.by_group_size: dict[int, int] = {}  # group size -> bytes received in such groups
        self._originals: dict[str, object] = {}

    def __enter__(self) -> ReceivedCounter:
        for name, received in (
            ("all_to_all_single", lambda out, inp, size: _nbytes(out) * (size - 1) // size),
            ("all_gather_single", lambda out, inp, size: _nbytes(out) - _nbytes(inp)),
        ):
            self._originals[name] = original = getattr(dist, name)
            setattr(dist, name, self._counted(original, received))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _counted(self, original, received):
        def counted(out, inp, *args, **kwargs):
            size = _group_size(kwargs)
            self.received += received(out, inp, size)
            self.by_group_size[size] = self.by_group_size.get(size, 0) + received(out, inp, size)
            return original(out, inp, *args, **kwargs)

        return counted


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def gather_every_row(comm: Communicator, tensor: torch.Tensor, codec: BlockCodec) -> None:
    """The design replaced by [Note: quantized all-reduce]: every replica's whole row
    all-gathered (the sum is not formed; only the bytes matter here)."""
    rows = torch.empty(comm.size * tensor.numel(), dtype=tensor.dtype)
    quantized.all_gather(comm, rows, tensor, purpose="grads", unit="u", codec=codec).wait()


def hierarchical(comm: Communicator, tensor: torch.Tensor, codec: BlockCodec) -> None:
    """qgZ's across-replica sum as the hybrid strategies run it."""
    quantized.all_reduce(comm, tensor, purpose="grads", unit="u", codec=codec).wait()


def measure(num_replicas: int, numel: int, codec: BlockCodec, reduce=hierarchical) -> dict:
    """Bytes rank 0 of ``num_replicas`` receives in ``reduce`` of ``numel`` fp32 values."""
    with fake_ranks(num_replicas):
        comm = Communicator(dist.group.WORLD, CommLedger())
        tensor = torch.zeros(numel)
        with ReceivedCounter() as counter:
            reduce(comm, tensor, codec)
        records = comm.ledger.records
    return {
        "received": counter.received,
        "ledger_wire": sum(r.wire_bytes for r in records),
        "ledger_unquantized_wire": sum(r.unquantized_wire_bytes for r in records),
    }


def fp32_ring_bytes(numel: int, num_replicas: int) -> int:
    """What a ring all-reduce of ``numel`` fp32 values receives per rank."""
    chunk = -(-numel // num_replicas)
    return 2 * (num_replicas - 1) * chunk * FP32_BYTES


def target_bytes(numel: int, num_replicas: int, codec: BlockCodec) -> int:
    """The ring all-reduce's bytes with each chunk quantized (values, then scales)."""
    chunk = -(-numel // num_replicas)
    values = -(-chunk * codec.bits // 8)
    scales = -(-chunk // codec.block_size) * SCALE_BYTES
    return 2 * (num_replicas - 1) * (values + scales)


def table(numel: int, codec: BlockCodec, replicas: list[int]) -> list[str]:
    lines = [
        f"n = {numel:,} fp32 values, int{codec.bits}, blocks of {codec.block_size}; "
        "bytes received per rank",
        f"{'R':>3} {'qgZ hier.':>12} {'ledger':>12} {'fp32 ring':>12} {'target':>12} "
        f"{'gather all':>12} {'x fp32':>7} {'x target':>8}",
    ]
    for r in replicas:
        got = measure(r, numel, codec)
        old = measure(r, numel, codec, reduce=gather_every_row)["received"]
        fp32, target = fp32_ring_bytes(numel, r), target_bytes(numel, r, codec)
        lines.append(
            f"{r:>3} {got['received']:>12,} {got['ledger_wire']:>12,.0f} {fp32:>12,} "
            f"{target:>12,} {old:>12,} {got['received'] / fp32:>7.3f} "
            f"{got['received'] / target:>8.3f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--bits", type=int, default=8, choices=(8, 4))
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--replicas", default="2-16", help="a range a-b or a list a,b,c")
    args = parser.parse_args()
    if "-" in args.replicas:
        low, high = (int(x) for x in args.replicas.split("-"))
        replicas = list(range(low, high + 1))
    else:
        replicas = [int(x) for x in args.replicas.split(",")]
    print("\n".join(table(args.numel, BlockCodec(args.bits, args.block_size), replicas)))


if __name__ == "__main__":
    main()
