"""``ShardedModule.clip_grad_norm_`` equals ``torch.nn.utils.clip_grad_norm_`` on the reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.dist.harness import STRATEGIES, WORLD_SIZES, run_ranks
from tests.dist.parity import (
    Case,
    batch_for,
    build_model,
    check_shards,
    clipped_grad_multiple,
    concat,
    loss_for,
    make_optimizer,
    norm_tol,
    reordered_tol,
    trainable_numel,
    wrap_case,
)

NORM_TYPES = (2.0, 1.0, math.inf)
# Small enough that every step clips (the model's gradient norms are ~1-10).
MAX_NORM = 0.3
NUM_STEPS = 2  # step 0 leaves `extra` without gradients; `pos` is frozen throughout


def _clipped_tol(reference, norm_type: float, num_steps: int) -> dict:
    """SGD steps of clipped gradients against the reordered reference (tests/tolerances.py)."""
    multiple = clipped_grad_multiple(trainable_numel(reference), MAX_NORM, norm_type)
    return reordered_tol("sgd", num_steps, grad_multiple=multiple)


def _clip_run(rank: int, world_size: int, strategy: str, norm_type: float) -> list[float]:
    model = build_model("gpt")
    reference = copy.deepcopy(model)
    sharded = wrap_case(model, Case(strategy=strategy))
    optim, ref_optim = make_optimizer(sharded, "sgd"), make_optimizer(reference, "sgd")
    norms = []
    for step in range(NUM_STEPS):
        batches = [batch_for("gpt", 1000 * step + r) for r in range(world_size)]
        loss_for("gpt", reference, concat(batches), step).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type)
        loss_for("gpt", sharded, batches[rank], step).backward()
        sharded.comm_ledger.reset()
        norm = sharded.clip_grad_norm_(MAX_NORM, norm_type)
        tol = norm_tol(norm_type, reference, ref_norm)
        torch.testing.assert_close(
            norm, ref_norm, msg=lambda m: f"{strategy} {norm_type}: {m}", **tol
        )
        assert ref_norm > MAX_NORM, "the test must actually clip"
        optim.step()
        # Gradients were reduced in backward (ZeRO-1 too): neither clipping nor the
        # step's pre-hook may reduce them again.
        assert sharded.comm_ledger.count("reduce_scatter", "grads") == 0
        assert sharded.comm_ledger.count("all_reduce", "grads") == 0
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        check_shards(
            sharded, reference, exact=False, tol=_clipped_tol(reference, norm_type, step + 1)
        )
        norms.append(float(norm))
    return norms


def clip_worker(rank: int, world_size: int) -> dict:
    result = {
        (strategy, norm_type): _clip_run(rank, world_size, strategy, norm_type)
        for strategy in STRATEGIES
        for norm_type in NORM_TYPES
    }
    result["errors"] = _bad_argument_errors()
    return result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_clip_grad_norm_matches_torch(world_size):
    results = run_ranks(clip_worker, world_size)
    assert all(r == results[0] for r in results), "ranks disagree on the norm"
    errors = results[0]["errors"]
    assert len(errors) == 3
    assert "norm_type" in errors[0] and "norm_type" in errors[1] and "max_norm" in errors[2]


def _bad_argument_errors() -> list[str]:
    sharded = wrap_case(build_model("gpt"), Case())
    errors = []
    for max_norm, norm_type in ((1.0, -2.0), (1.0, "fro"), ("big", 2.0)):
        try:
            sharded.clip_grad_norm_(max_norm, norm_type)
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    return errors


def _hybrid_clip(rank: int, world_size: int, strategy: str, norm_type: float) -> float:
    model = build_model("gpt")
    reference = copy.deepcopy(model)
    sharded = wrap_case(model, Case(strategy=strategy, hybrid_shard_size=2))
    optim, ref_optim = make_optimizer(sharded, "sgd"), make_optimizer(reference, "sgd")
    batches = [batch_for("gpt", r) for r in range(world_size)]
    loss_for("gpt", reference, concat(batches), 1).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type)
    loss_for("gpt", sharded, batches[rank], 1).backward()
    norm = sharded.clip_grad_norm_(MAX_NORM, norm_type)
    tol = norm_tol(norm_type, reference, ref_norm)
    torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"{strategy} {norm_type}: {m}", **tol)
    optim.step()
    ref_optim.step()
    check_shards(sharded, reference, exact=False, tol=_clipped_tol(reference, norm_type, 1))
    return float(norm)


def hybrid_clip_worker(rank: int, world_size: int) -> dict:
    return {
        (strategy, norm_type): _hybrid_clip(rank, world_size, strategy, norm_type)
        for strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
        for norm_type in (2.0, math.inf)
    }


def test_clip_grad_norm_hybrid_counts_replicas_once():
    """Two shard groups of two ranks: summing over replicas too would double the norm."""
    results = run_ranks(hybrid_clip_worker, 4)
    assert all(r == results[0] for r in results)
