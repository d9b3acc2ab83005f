"""Prefetch and overlapped reductions change when collectives run, never the numbers."""

from __future__ import annotations

import pytest

import shardwrap
from tests import models
from tests.dist.harness import run_ranks
from tests.dist.parity import Case, build_model, make_optimizer, train_and_compare, wrap_policy

SCHEDULES = [
    {"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE"},
    {"forward_prefetch": True, "backward_prefetch": "BACKWARD_POST"},
    {"forward_prefetch": False, "backward_prefetch": None},
    {"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE", "keep_root_gathered": True},
]


def _schedules_worker(rank: int, world_size: int, strategy: str) -> int:
    for schedule in SCHEDULES:
        train_and_compare(rank, world_size, Case(strategy=strategy, num_steps=3, **schedule))
    return len(SCHEDULES)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_schedules_match_reference(strategy: str, world_size: int) -> None:
    assert run_ranks(_schedules_worker, world_size, strategy) == [len(SCHEDULES)] * world_size


def _traffic_worker(rank: int, world_size: int, keep_root: bool) -> dict:
    model = shardwrap.ShardedModule(
        build_model("gpt"), auto_wrap_policy=wrap_policy("gpt"), forward_prefetch=True
    )
    if keep_root:
        model.set_reshard_after_forward(False)
    optim = make_optimizer(model, "adamw")
    held_between = []
    for step in range(3):
        model.comm_ledger.reset()
        loss = models.gpt_loss(model, models.gpt_batch(step + rank))
        held_between.append([u.handle.full_storage_bytes > 0 for u in model.units])
        loss.backward()
        optim.step()
        optim.zero_grad()
    return {
        "gathers": model.comm_ledger.count("all_gather", "params"),
        "held_between": held_between[-1],
        "after_step": [u.handle.full_storage_bytes for u in model.units],
        "num_units": len(model.units),
    }


def test_prefetch_keeps_traffic_and_memory_as_the_theory() -> None:
    plain = run_ranks(_traffic_worker, 2, False)[0]
    # prefetching moves collectives earlier, it adds none; nothing stays gathered
    assert plain["gathers"] == 2 * plain["num_units"]
    assert plain["held_between"] == [False] * plain["num_units"]
    assert plain["after_step"] == [0] * plain["num_units"]
    root_kept = run_ranks(_traffic_worker, 2, True)[0]
    # the root stays gathered from forward to backward: one all-gather less per step
    assert root_kept["gathers"] == 2 * root_kept["num_units"] - 1
    assert root_kept["held_between"] == [True] + [False] * (root_kept["num_units"] - 1)
    assert root_kept["after_step"] == [0] * root_kept["num_units"]
