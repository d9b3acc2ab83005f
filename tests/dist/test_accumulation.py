"""Gradient accumulation: ``no_sync`` and plain accumulation equal one big batch."""

from __future__ import annotations

import contextlib
import copy

import pytest

from tests.dist.harness import STRATEGIES, WORLD_SIZES, run_ranks
from tests.dist.parity import (
    Case,
    batch_for,
    build_model,
    check_shards,
    concat,
    loss_for,
    make_optimizer,
    wrap_case,
)
from tests.tolerances import reordered_param_tol

NUM_MICRO_BATCHES = 2
NUM_STEPS = 2
GRAD_PURPOSES = ("grads", "grad_presence")


def _grad_traffic(ledger) -> int:
    return sum(
        ledger.count(kind, purpose)
        for kind in ("reduce_scatter", "all_reduce")
        for purpose in GRAD_PURPOSES
    )


def _accumulate(rank: int, world_size: int, strategy: str, use_no_sync: bool) -> dict:
    case = Case(strategy=strategy)
    model = build_model(case.model)
    reference = copy.deepcopy(model)
    sharded = wrap_case(model, case)
    # Micro-batches sum the gradient in another order than the big batch: AdamW with the
    # reorder-safe eps, so the parameters' difference has a derived bound (it failed torch's
    # default fp32 tolerance at 3 ranks under ATEN_CPU_CAPABILITY=default, 1.27e-5 > 1e-5).
    kind = "adamw"  # reorder-safe: the bound of tests/tolerances.py
    optim, ref_optim = make_optimizer(sharded, kind), make_optimizer(reference, kind)
    counts = {"non_final_grad_traffic": 0, "non_final_gathers": 0, "final_grad_traffic": 0}
    for step in range(NUM_STEPS):
        micro = [
            [batch_for("gpt", 1000 * step + 10 * r + k) for k in range(NUM_MICRO_BATCHES)]
            for r in range(world_size)
        ]
        every = [b for per_rank in micro for b in per_rank]
        loss_for("gpt", reference, concat(every), step).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        for k, batch in enumerate(micro[rank]):
            final = k == NUM_MICRO_BATCHES - 1
            sync_off = use_no_sync and not final
            sharded.comm_ledger.reset()
            with sharded.no_sync() if sync_off else contextlib.nullcontext():
                (loss_for("gpt", sharded, batch, step) / NUM_MICRO_BATCHES).backward()
            if final:
                optim.step()
                counts["final_grad_traffic"] += _grad_traffic(sharded.comm_ledger)
            else:
                counts["non_final_grad_traffic"] += _grad_traffic(sharded.comm_ledger)
                counts["non_final_gathers"] += sharded.comm_ledger.count("all_gather", "params")
        optim.zero_grad()
        check_shards(sharded, reference, exact=False, tol=reordered_param_tol(step + 1))
    return counts


def accumulation_worker(rank: int, world_size: int) -> dict:
    return {
        (strategy, use_no_sync): _accumulate(rank, world_size, strategy, use_no_sync)
        for strategy in STRATEGIES
        for use_no_sync in (True, False)
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_accumulation_matches_big_batch(world_size):
    """Micro-batches (with and without ``no_sync``) give the big batch's shards within the
    reordering bound, and move gradients only in the last one.

    Negative controls, run once (2026-12-03, AMD EPYC): the first micro-batch dropped fails
    at world 1 (0.0195 off against the 1.4e-4 allowed); the micro-batch losses not divided
    by their count (gradients doubled) fails at worlds 1, 2 and 3 (1.7e-3 off).
    """
    results = run_ranks(accumulation_worker, world_size)
    for counts in results:
        for (strategy, use_no_sync), c in counts.items():
            where = f"{strategy}, no_sync={use_no_sync}: {c}"
            if world_size == 1:
                assert c["final_grad_traffic"] == 0, where  # a group of one moves nothing
                continue
            assert c["final_grad_traffic"] > 0, where
            if use_no_sync:
                assert c["non_final_grad_traffic"] == 0, where
            else:
                assert c["non_final_grad_traffic"] > 0, where
            if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
                # Parameters are still gathered in every micro-batch.
                assert c["non_final_gathers"] >= NUM_MICRO_BATCHES - 1, where
