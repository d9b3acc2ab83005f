"""The benchmark's collective counter: bytes per kind, aliases and sends counted once."""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.comm_count import CollectiveCounter
from tests.dist.harness import run_ranks

FP32_BYTES = 4


def _count(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    counter = CollectiveCounter()
    counter.install()
    shard = torch.full((6,), float(rank))
    full = torch.empty(6 * world_size)
    counter.counting = True
    dist.all_gather_into_tensor(full, shard)
    dist._all_gather_base(full, shard)  # an alias that calls all_gather_into_tensor
    dist.reduce_scatter_tensor(torch.empty(6), full)
    dist.all_reduce(shard)
    peer = 1 - rank  # isend goes through ProcessGroup.send: counted once, as "send"
    works = [dist.isend(shard, peer), dist.irecv(torch.empty(6), peer)]
    for work in works:
        work.wait()
    counter.counting = False
    dist.all_reduce(shard)  # not counted
    assert torch.equal(full[6:], torch.ones(6)), "the wrapped collective must still work"
    return counter.reset()


def test_counter_counts_input_bytes_once_per_call() -> None:
    world_size = 2
    for totals in run_ranks(_count, world_size):
        assert totals == {
            "all_gather": (2, 2 * 6 * FP32_BYTES),
            "reduce_scatter": (1, 6 * world_size * FP32_BYTES),
            "all_reduce": (1, 6 * FP32_BYTES),
            "send": (1, 6 * FP32_BYTES),
        }
