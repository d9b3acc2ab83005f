"""Data-parallel buckets share one buffer and follow their plan.

See [Note: in-place buckets] in ``shardwrap/runtime/reduce_bucket.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwrap
from shardwrap.assemble.root import root_of
from shardwrap.policies import ModuleWrapPolicy
from tests import models
from tests.dist.harness import run_ranks
from tests.dist.parity import build_model, wrap_policy

EVERYTHING = 1 << 30


def _storages(params) -> set[int]:
    return {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}


def _one_bucket_worker(rank: int, world_size: int) -> dict:
    model = shardwrap.ShardedModule(
        build_model("mlp"), sharding_strategy="NO_SHARD", auto_wrap_policy=wrap_policy("mlp")
    )
    model.set_reduce_bucket_size(EVERYTHING)
    handles = [u.handle for u in model.units if u.handle is not None]
    models.mlp_loss(model, models.mlp_batch(rank)).backward()
    return {
        "num_handles": len(handles),
        "storages": len(_storages(p for h in handles for p in h.shard_params)),
        "reductions": model.comm_ledger.count("all_reduce", "grads"),
    }


def test_one_bucket_hands_out_slots_of_one_buffer() -> None:
    for result in run_ranks(_one_bucket_worker, 2):
        assert result["num_handles"] == 4
        assert result["reductions"] == 1
        assert result["storages"] == 1  # every gradient a view of the bucket's buffer


def _out_of_plan_worker(rank: int, world_size: int) -> dict:
    model = shardwrap.ShardedModule(
        build_model("mlp"), sharding_strategy="NO_SHARD", auto_wrap_policy=wrap_policy("mlp")
    )
    model.set_reduce_bucket_size(EVERYTHING)
    h0, h1, h2 = [u.handle for u in model.units if u.handle is not None][:3]
    with model.no_sync():  # local gradients stay on the full views, unreduced
        models.mlp_loss(model, models.mlp_batch(rank)).backward()
    expected = {}
    for h in (h0, h1, h2):
        for info, param in zip(h.layout.params, h.full_params, strict=True):
            total = param.grad.clone()
            dist.all_reduce(total)
            expected[info.fqn] = total / world_size
    model.comm_ledger.reset()
    schedule = root_of(model).runtime.schedule
    schedule.start_reduce(h1, [h2, h0])  # plans h1, h2, h0
    schedule.start_reduce(h0, [h2])  # out of plan: h1 goes alone, h0 plans h0, h2
    schedule.start_reduce(h2, [])  # completes the second plan
    schedule.finish_reduces()
    root_of(model).runtime.vote_and_assign(model.units)
    matches = all(
        torch.equal(p.grad.reshape(-1), expected[info.fqn].reshape(-1))
        for h in (h0, h1, h2)
        for info, p in zip(h.layout.params, h.shard_params, strict=True)
    )
    numels = [r.num_bytes // 4 for r in model.comm_ledger.records if r.purpose == "grads"]
    return {
        "matches": matches,
        "numels": numels,
        "expected_numels": [
            h1.grads.flat_grad_numel,
            h0.grads.flat_grad_numel + h2.grads.flat_grad_numel,
        ],
        "h0_h2_share": len(_storages([*h0.shard_params, *h2.shard_params])) == 1,
    }


def test_an_arrival_out_of_plan_closes_the_bucket() -> None:
    for result in run_ranks(_out_of_plan_worker, 2):
        assert result["matches"]
        assert result["numels"] == result["expected_numels"]
        assert result["h0_h2_share"]


def _default_worker(rank: int, world_size: int, strategy: str) -> dict:
    model = shardwrap.ShardedModule(
        build_model("mlp"), sharding_strategy=strategy, auto_wrap_policy=wrap_policy("mlp")
    )
    models.mlp_loss(model, models.mlp_batch(rank)).backward()
    ledger = model.comm_ledger
    return {
        "num_handles": sum(u.handle is not None for u in model.units),
        "reductions": ledger.count("all_reduce", "grads") + ledger.count("reduce_scatter", "grads"),
    }


def test_only_data_parallel_units_bucket_by_default() -> None:
    # [Note: default reduce buckets]: the MLP's units fit one 25 MiB bucket.
    for result in run_ranks(_default_worker, 2, "NO_SHARD"):
        assert result["reductions"] == 1
    for result in run_ranks(_default_worker, 2, "FULL_SHARD"):
        assert result["reductions"] == result["num_handles"] == 4


def _issue_wait_worker(rank: int, world_size: int, strategy: str) -> dict:
    model = shardwrap.ShardedModule(
        build_model("mlp"), sharding_strategy=strategy, auto_wrap_policy=wrap_policy("mlp")
    )
    model.set_reduce_bucket_size(1)  # each unit fills a bucket alone
    h0, h1 = [u.handle for u in model.units if u.handle is not None][:2]
    with model.no_sync():
        models.mlp_loss(model, models.mlp_batch(rank)).backward()
    schedule = root_of(model).runtime.schedule
    schedule.start_reduce(h1, [h0])
    schedule.start_reduce(h0, [])  # issuing the second bucket
    first_done = h1.grads.pending_grad_shard is not None
    schedule.finish_reduces()
    return {
        "first_done": first_done,
        "both_done": None not in (h0.grads.pending_grad_shard, h1.grads.pending_grad_shard),
    }


@pytest.mark.parametrize(("strategy", "waits"), [("NO_SHARD", False), ("FULL_SHARD", True)])
def test_only_concatenating_buckets_wait_before_the_next(strategy: str, waits: bool) -> None:
    # An in-place bucket holds no memory of its own, so the next bucket does not wait for
    # it ([Note: in-place buckets]); a concatenated input is bounded to one in flight.
    for result in run_ranks(_issue_wait_worker, 2, strategy):
        assert result["first_done"] is waits
        assert result["both_done"]


class _Branches(torch.nn.Module):
    """A trunk and three heads; each step takes one head, so the bucket plan changes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(4, 8)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(3))

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](self.trunk(x))


def _changing_plans_worker(rank: int, world_size: int) -> list[int]:
    model = shardwrap.ShardedModule(
        _Branches(),
        sharding_strategy="NO_SHARD",
        auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
    )
    kept = []
    for step in range(6):
        model(torch.randn(2, 4), head=step % 3).sum().backward()
        model.zero_grad(set_to_none=True)
        kept.append(len(root_of(model).runtime.schedule.bucket_slots.buffers()))
    return kept


def test_buffers_of_plans_no_longer_used_are_dropped() -> None:
    # three plans in turn ([head, trunk]): between steps only the last step's stays (it
    # kept all three, one more each step, before plans were dropped)
    for kept in run_ranks(_changing_plans_worker, 2):
        assert kept == [1] * 6
