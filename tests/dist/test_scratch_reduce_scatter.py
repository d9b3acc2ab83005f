"""A reduce-scatter of a scratch input (in-place all-reduce on gloo) equals the plain one.

See [Note: gloo reduce-scatter] in ``shardwrap/collectives.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwrap.collectives import CommLedger, Communicator
from tests.dist.harness import run_ranks

SHARD_NUMEL = 7


def _worker(rank: int, world_size: int) -> dict:
    ledger = CommLedger()
    comm = Communicator(dist.group.WORLD, ledger)
    torch.manual_seed(100 + rank)
    full = torch.randn(world_size * SHARD_NUMEL, dtype=torch.float32)
    expected = torch.empty(SHARD_NUMEL)
    comm.reduce_scatter(expected, full.clone(), purpose="grads").wait()
    plain_record = ledger.records[-1]
    got = torch.empty(SHARD_NUMEL)
    comm.reduce_scatter(got, full.clone(), purpose="grads", input_is_scratch=True).wait()
    scratch_record = ledger.records[-1]
    # The reference: every rank's input, summed, this rank's slice.
    every = [torch.empty_like(full) for _ in range(world_size)]
    dist.all_gather(every, full)
    reference = torch.stack(every).sum(0).view(world_size, -1)[rank]
    return {
        "took_gloo_path": comm._gloo,  # otherwise this test would compare a path with itself
        "plain_equals_reference": torch.allclose(expected, reference),
        "scratch_equals_plain": torch.equal(got, expected),
        "same_record": (scratch_record.kind, scratch_record.num_bytes)
        == (plain_record.kind, plain_record.num_bytes),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_scratch_reduce_scatter_matches_plain(world_size: int) -> None:
    for result in run_ranks(_worker, world_size):
        assert result == {
            "took_gloo_path": True,
            "plain_equals_reference": True,
            "scratch_equals_plain": True,
            "same_record": True,
        }
