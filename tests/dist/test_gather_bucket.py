"""All-gather buckets: fewer collectives, the same bytes, the same numbers.

TinyGPT's units gather 14,720 (root) and 50,432 bytes (each block) in fp32 on two ranks.
"""

from __future__ import annotations

import pytest
import torch

import shardwrap
from shardwrap.comm.collectives import ROOT_LABEL
from tests import models
from tests.dist import test_activation_checkpointing as checkpointing
from tests.dist.harness import run_ranks
from tests.dist.parity import (
    Case,
    batch_for,
    build_model,
    check_shards,
    concat,
    loss_for,
    make_optimizer,
    train_and_compare,
    wrap_case,
    wrap_policy,
)
from tests.tolerances import reordered_param_tol

EVERYTHING = 1 << 30  # every unit in one bucket
ROOT_AND_A_BLOCK = 70_000  # root + one block fit, a second block does not: mixed buckets
NUM_UNITS = 3

SCHEDULES = [
    {"all_gather_bucket_bytes": EVERYTHING},
    {"all_gather_bucket_bytes": ROOT_AND_A_BLOCK, "forward_prefetch": True},
    {"all_gather_bucket_bytes": ROOT_AND_A_BLOCK, "backward_prefetch": "BACKWARD_POST"},
    {"all_gather_bucket_bytes": EVERYTHING, "keep_root_gathered": True},
    {"all_gather_bucket_bytes": EVERYTHING, "reduce_bucket_bytes": EVERYTHING},
    {"all_gather_bucket_bytes": EVERYTHING, "param_persistence_threshold": 5_000},
    {"all_gather_bucket_bytes": 2_000, "model": "mlp"},  # two of the four linear units
]


def _parity_worker(rank: int, world_size: int, strategies: list[str], schedules=SCHEDULES) -> int:
    for strategy in strategies:
        for schedule in schedules:
            train_and_compare(rank, world_size, Case(strategy=strategy, num_steps=3, **schedule))
    return len(strategies) * len(schedules)


def test_buckets_match_reference() -> None:
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM"]
    assert run_ranks(_parity_worker, 2, strategies) == [len(strategies) * len(SCHEDULES)] * 2


def test_uneven_shards_match_reference() -> None:
    schedules = SCHEDULES[:3]  # three ranks pad every unit: mixed buckets, both prefetches
    assert run_ranks(_parity_worker, 3, ["FULL_SHARD"], schedules) == [len(schedules)] * 3


def _traffic_worker(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """The third step's parameter all-gathers (the first has no order to bucket by)."""
    results = []
    for options in runs:
        case = Case(**options)
        model = wrap_case(build_model("gpt"), case)
        optim = make_optimizer(model, "adamw")
        for step in range(3):
            model.comm_ledger.reset()
            models.gpt_loss(model, models.gpt_batch(10 * step + rank), use_extra=True).backward()
            optim.step()
            optim.zero_grad()
        ledger = model.comm_ledger
        results.append(
            {
                "count": ledger.count("all_gather", "params"),
                "bytes": ledger.bytes("all_gather", "params"),
                "held_after": [u.handle.full_storage_bytes for u in model.units],
                "labels": [r.unit for r in ledger.records if r.kind == "all_gather"],
            }
        )
    return results


@pytest.mark.parametrize(
    ("strategy", "gathers", "fused"),
    # FULL_SHARD: twice per unit, but the last unit of forward stays gathered into backward
    [("FULL_SHARD", 2 * NUM_UNITS - 1, 2), ("SHARD_GRAD_OP", NUM_UNITS, 1),
     ("SHARD_OPTIM", NUM_UNITS, 1)],
)  # fmt: skip
def test_fewer_all_gathers_same_bytes(strategy: str, gathers: int, fused: int) -> None:
    runs = [{"strategy": strategy}, {"strategy": strategy, "all_gather_bucket_bytes": EVERYTHING}]
    off, on = run_ranks(_traffic_worker, 2, runs)[0]
    assert off["count"] == gathers
    assert on["count"] == fused  # one bucket for forward (and one for backward)
    assert on["bytes"] == off["bytes"] > 0
    assert on["held_after"] == off["held_after"]  # nothing gathered is left behind


def test_prefetches_issue_buckets() -> None:
    """Root kept gathered, both prefetches on: the buckets are the prefetched gathers."""
    common = {"forward_prefetch": True, "keep_root_gathered": True}
    off, on = run_ranks(
        _traffic_worker, 2, [common, {**common, "all_gather_bucket_bytes": EVERYTHING}]
    )[0]
    # backward gathers only blocks.0: the root and blocks.1, the last unit of forward, stay
    # gathered ([Note: the last unit of forward stays gathered])
    assert off["labels"] == [ROOT_LABEL, "blocks.0", "blocks.1", "blocks.0"]
    # forward: the root takes both blocks along
    assert on["labels"] == [f"{ROOT_LABEL}..blocks.1 (3 units)", "blocks.0"]
    assert on["bytes"] == off["bytes"]
    assert on["held_after"] == off["held_after"]


def _train_twins(rank: int, variants: list[dict]) -> list[shardwrap.ShardedModule]:
    """One GPT per ``ShardedModule`` keyword set (plus ``bucket``), trained alike 3 steps."""
    twins = []
    for options in variants:
        options = dict(options)
        bucket_bytes = options.pop("bucket", 0)
        model = shardwrap.ShardedModule(
            build_model("gpt"),
            auto_wrap_policy=wrap_policy("gpt"),
            forward_prefetch=True,
            **options,
        )
        model.set_all_gather_bucket_size(bucket_bytes)
        twins.append((model, make_optimizer(model, "adamw")))
    for step in range(3):
        for model, optim in twins:
            models.gpt_loss(model, models.gpt_batch(10 * step + rank), use_extra=True).backward()
            optim.step()
            optim.zero_grad()
    return [model for model, _ in twins]


def _same_params(a: shardwrap.ShardedModule, b: shardwrap.ShardedModule) -> None:
    full_a, full_b = a.state_dict(), b.state_dict()
    for name, value in full_a.items():
        torch.testing.assert_close(
            value, full_b[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def _twins_worker(rank: int, world_size: int) -> list[int]:
    """Buckets gather the same (cast, staged) values, so training is bit for bit equal."""
    bf16 = {"mixed_precision": shardwrap.MixedPrecision(param_dtype=torch.bfloat16)}
    offload = {"cpu_offload": shardwrap.CPUOffload(offload_params=True)}
    plain16, bucketed16, plain, offloaded, persistent = _train_twins(
        rank,
        [
            bf16,
            {**bf16, "bucket": EVERYTHING},
            {},
            {**offload, "bucket": EVERYTHING},
            {**offload, "bucket": EVERYTHING, "param_persistence_threshold": 5_000},
        ],
    )
    _same_params(plain16, bucketed16)
    _same_params(plain, offloaded)
    # the root all-reduces, not reduce-scatters: at 2 ranks both add the same two
    # gradients (a sum of two commutes), in the same flat layout, so exactly too
    _same_params(plain, persistent)
    return [m.comm_ledger.count("all_gather", "params") for m in (plain16, bucketed16, offloaded)]


def test_buckets_equal_unbucketed_bit_for_bit_in_bf16_and_offloaded() -> None:
    for plain_count, bucketed_count, offloaded_count in run_ranks(_twins_worker, 2):
        assert 0 < bucketed_count < plain_count and offloaded_count == bucketed_count


def _checkpointing_worker(rank: int, world_size: int) -> dict:
    """Activation checkpointing re-runs block forwards in backward; buckets stay exact."""
    gathers = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for mode in ("inner_non_reentrant", "wrapper_after_wrap_reentrant"):
            sharded, reference = checkpointing._prepare(mode, strategy)
            sharded.set_all_gather_bucket_size(EVERYTHING)
            kind = "adamw"  # reorder-safe: the bound of tests/tolerances.py
            optim, ref_optim = make_optimizer(sharded, kind), make_optimizer(reference, kind)
            for step in range(3):
                batches = [batch_for("gpt", 1000 * step + r) for r in range(world_size)]
                loss_for("gpt", reference, concat(batches), step).backward()
                ref_optim.step()
                ref_optim.zero_grad()
                sharded.comm_ledger.reset()
                loss_for("gpt", sharded, batches[rank], step).backward()
                optim.step()
                optim.zero_grad()
                check_shards(sharded, reference, exact=False, tol=reordered_param_tol(step + 1))
            gathers[(strategy, mode)] = sharded.comm_ledger.count("all_gather", "params")
    return gathers


def test_buckets_under_activation_checkpointing() -> None:
    gathers = run_ranks(_checkpointing_worker, 2)[0]
    for (strategy, mode), count in gathers.items():
        kind = "reentrant_wrapper" if mode == "wrapper_after_wrap_reentrant" else "plain"
        assert 0 < count < checkpointing.EXPECTED_GATHERS[strategy][kind], (strategy, mode, count)


def test_bucket_size_is_validated(one_rank) -> None:
    model = shardwrap.ShardedModule(build_model("mlp"))
    with pytest.raises(TypeError, match="num_bytes"):
        model.set_all_gather_bucket_size(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_bytes"):
        model.set_all_gather_bucket_size(-1)
    model.set_all_gather_bucket_size(0)
