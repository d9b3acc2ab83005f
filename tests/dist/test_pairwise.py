"""Pairwise all-gather and reduce-scatter on gloo against torch's own collectives.

See [Note: pairwise collectives on gloo] in ``shardwrap/comm/pairwise.py``.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from shardwrap.comm import posting
from shardwrap.comm.collectives import CommLedger, Communicator
from tests.dist.harness import MULTI_RANK_WORLD_SIZES, run_ranks

SHARD_NUMEL = 7


def _inputs(rank: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(size * SHARD_NUMEL, generator=generator).to(dtype)


def _rank_order_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0] + tensors[1]
    for tensor in tensors[2:]:
        total = total + tensor
    return total


def _check_group(comm: Communicator, group, dtype: torch.dtype) -> dict:
    rank, size = comm.rank, comm.size
    full = _inputs(rank, size, dtype)
    shard = full[:SHARD_NUMEL].clone() + rank
    # Two collectives in flight at once on one group, plus one on a second communicator
    # over the same group: their tags must keep them apart.
    other = Communicator(group, comm.ledger)
    gathered = torch.empty(size * SHARD_NUMEL, dtype=dtype)
    reduced = torch.empty(SHARD_NUMEL, dtype=dtype)
    reduced_again = torch.empty(SHARD_NUMEL, dtype=dtype)
    works = [
        comm.all_gather(gathered, shard, purpose="params"),
        comm.reduce_scatter(reduced, full, purpose="grads"),
        other.reduce_scatter(reduced_again, full, purpose="grads"),
    ]
    for work in reversed(works):
        work.wait()
    every_shard = torch.empty(size * SHARD_NUMEL, dtype=dtype)
    dist.all_gather_single(every_shard, shard, group=group)
    every_full = [torch.empty_like(full) for _ in range(size)]
    dist.all_gather(every_full, full, group=group)
    expected = _rank_order_sum([f.view(size, -1)[rank] for f in every_full])
    # An all-gather into the output's own slice (no copy of the shard).
    in_place = torch.empty(size * SHARD_NUMEL, dtype=dtype)
    in_place.view(size, -1)[rank].copy_(shard)
    comm.all_gather(in_place, in_place.view(size, -1)[rank], purpose="params").wait()
    return {
        "gathered": torch.equal(gathered, every_shard),
        "in_place": torch.equal(in_place, every_shard),
        "reduced": torch.equal(reduced, expected),
        "reduced_again": torch.equal(reduced_again, expected),
        "input_unchanged": torch.equal(full, _inputs(rank, size, dtype)),
    }


def _blocked_rank_still_posts(world: Communicator) -> bool:
    """Rank 0 blocks in a torch collective with its pairwise posts still queued; the
    other ranks join that collective only once rank 0's posts reached them.
    See [Note: posting off the compute thread].
    """
    shard = torch.full((SHARD_NUMEL,), float(world.rank))
    gathered = torch.empty(world.size * SHARD_NUMEL)
    if world.rank == 0:  # hold the helper so the gather's posts are still queued below
        posting.post(lambda: time.sleep(0.3) or [])
    work = world.all_gather(gathered, shard, purpose="params")
    if world.rank != 0:
        work.wait()
    flag = torch.ones(1)
    dist.all_reduce(flag)  # blocking
    work.wait()
    expected = torch.arange(world.size, dtype=torch.float32).repeat_interleave(SHARD_NUMEL)
    return torch.equal(gathered, expected) and flag.item() == world.size


def _worker(rank: int, world_size: int) -> dict:
    ledger = CommLedger()
    world = Communicator(dist.group.WORLD, ledger)
    result = {"pairwise": world._pairwise(torch.empty(1))}
    result["blocked_rank_still_posts"] = _blocked_rank_still_posts(world)
    result["world"] = _check_group(world, dist.group.WORLD, torch.float32)
    result["bf16"] = _check_group(world, dist.group.WORLD, torch.bfloat16)
    # A subgroup of the last two ranks: peers are group ranks, not global ones.
    members = [world_size - 2, world_size - 1]
    sub = dist.new_group(members)
    if rank in members:
        sub_ledger = CommLedger()
        result["sub"] = _check_group(Communicator(sub, sub_ledger), sub, torch.float32)
        result["records"] = sorted({(r.kind, r.num_bytes) for r in sub_ledger.records})
    return result


@pytest.mark.parametrize("world_size", MULTI_RANK_WORLD_SIZES)
def test_pairwise_collectives_match_torch(world_size: int) -> None:
    all_true = dict.fromkeys(["gathered", "in_place", "reduced", "reduced_again"], True)
    all_true["input_unchanged"] = True
    fp32 = SHARD_NUMEL * 2 * 4
    for rank, result in enumerate(run_ranks(_worker, world_size)):
        assert result["pairwise"] is True  # otherwise torch would be compared with itself
        assert result["blocked_rank_still_posts"] is True
        assert result["world"] == all_true
        assert result["bf16"] == all_true
        if rank >= world_size - 2:
            assert result["sub"] == all_true
            # Records carry the full buffer's bytes, as torch's collectives do.
            assert result["records"] == [("all_gather", fp32), ("reduce_scatter", fp32)]
