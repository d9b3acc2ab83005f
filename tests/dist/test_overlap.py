"""Prefetch and overlapped reductions change when collectives run, never the numbers."""

from __future__ import annotations

import pytest
import torch

import shardwrap
from tests import models
from tests.dist.harness import MULTI_RANK_WORLD_SIZES, STRATEGIES, run_ranks
from tests.dist.parity import Case, build_model, make_optimizer, train_and_compare, wrap_policy

SCHEDULES = [
    {"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE"},
    {"forward_prefetch": True, "backward_prefetch": "BACKWARD_POST"},
    {"forward_prefetch": False, "backward_prefetch": None},
    {"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE", "keep_root_gathered": True},
    {"reduce_bucket_bytes": 0},  # every unit alone (the defaults bucket NO_SHARD's units)
    {"reduce_bucket_bytes": 40_000},  # a block and a half per bucket: mixed bucket sizes
    {"reduce_bucket_bytes": 1 << 30, "forward_prefetch": True},  # everything in one bucket
]


def _schedules_worker(rank: int, world_size: int, strategy: str) -> int:
    for schedule in SCHEDULES:
        train_and_compare(rank, world_size, Case(strategy=strategy, num_steps=3, **schedule))
    return len(SCHEDULES)


@pytest.mark.parametrize("world_size", MULTI_RANK_WORLD_SIZES)
@pytest.mark.parametrize("strategy", STRATEGIES)
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
    # prefetching moves collectives earlier, it adds none; only the last unit of forward
    # stays gathered ([Note: the last unit of forward stays gathered])
    assert plain["gathers"] == 2 * plain["num_units"] - 1
    assert plain["held_between"] == [False] * (plain["num_units"] - 1) + [True]
    assert plain["after_step"] == [0] * plain["num_units"]
    root_kept = run_ranks(_traffic_worker, 2, True)[0]
    # the root stays gathered from forward to backward too: one all-gather less again
    assert root_kept["gathers"] == 2 * root_kept["num_units"] - 2
    assert root_kept["held_between"] == [True] + [False] * (root_kept["num_units"] - 2) + [True]
    assert root_kept["after_step"] == [0] * root_kept["num_units"]


def _gathers_issued_worker(rank: int, world_size: int, strategy: str) -> list[int]:
    """All-gathers issued by the time each unit's forward starts, in the third step."""
    torch.manual_seed(0)
    model = shardwrap.ShardedModule(
        models.TinyGPT(depth=4),  # enough units that one-ahead and all-at-once differ
        sharding_strategy=strategy,
        auto_wrap_policy=wrap_policy("gpt"),
        forward_prefetch=True,
    )
    model.set_reshard_after_forward(False)  # the root stays gathered, as in the benchmark
    issued: list[int] = []
    for unit in model.units[1:]:
        unit.module.register_forward_pre_hook(
            lambda *_: issued.append(model.comm_ledger.count("all_gather", "params"))
        )
    optim = make_optimizer(model, "adamw")
    for step in range(3):
        issued.clear()
        model.comm_ledger.reset()
        models.gpt_loss(model, models.gpt_batch(step + rank)).backward()
        optim.step()
        optim.zero_grad()
    return issued


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "SHARD_OPTIM", "FULL_SHARD"])
def test_units_kept_to_backward_are_prefetched_together(strategy: str) -> None:
    issued = run_ranks(_gathers_issued_worker, 2, strategy)[0]
    num_units = len(issued) + 1
    assert num_units == 5
    if strategy == "FULL_SHARD":  # blocks free after forward: one unit ahead only
        assert issued == [min(i + 2, num_units) for i in range(1, num_units)]
    else:  # every unit's gather was issued when the root started its forward
        assert issued == [num_units] * (num_units - 1)


def _bucket_worker(rank: int, world_size: int, strategy: str) -> dict:
    model = shardwrap.ShardedModule(
        build_model("gpt"), sharding_strategy=strategy, auto_wrap_policy=wrap_policy("gpt")
    )
    model.set_reduce_bucket_size(1 << 30)
    optim = make_optimizer(model, "adamw")
    for step in range(2):
        model.comm_ledger.reset()
        models.gpt_loss(model, models.gpt_batch(step + rank)).backward()
        optim.step()
        optim.zero_grad()
    handles = [u.handle for u in model.units]
    return {
        "summary": model.comm_ledger.summary(),
        "padded_bytes": sum(h.layout.padded_numel * 4 for h in handles),
        "trainable_bytes": 4 * sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


@pytest.mark.parametrize(
    "strategy,kind", [("FULL_SHARD", "reduce_scatter"), ("SHARD_OPTIM", "reduce_scatter"),
                      ("NO_SHARD", "all_reduce")]
)  # fmt: skip
def test_one_bucket_means_one_gradient_collective(strategy: str, kind: str) -> None:
    result = run_ranks(_bucket_worker, 2, strategy)[0]
    # all units' gradients in one collective of the same total size: the padded flat
    # gradients, or without shards the trainable parameters alone ([Note: packed gradients])
    size = result["trainable_bytes"] if strategy == "NO_SHARD" else result["padded_bytes"]
    assert result["summary"][(kind, "grads")] == (1, size)


def test_bucket_size_is_validated(one_rank) -> None:
    model = shardwrap.ShardedModule(torch.nn.Linear(4, 4))
    for setter in (model.set_reduce_bucket_size, model.set_all_gather_bucket_size):
        with pytest.raises(TypeError, match="num_bytes"):
            setter(1.5)  # type: ignore[arg-type]
