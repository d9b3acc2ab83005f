"""The memory planner against the bytes each rank actually holds, for every stage."""

from __future__ import annotations

import pytest
import torch

import shardwrap
from shardwrap.planner.estimate import STAGE_STRATEGIES, estimate_memory
from tests.dist.harness import MULTI_RANK_WORLD_SIZES, run_ranks
from tests.dist.parity import batch_for, build_model, loss_for, make_optimizer, wrap_policy

# The optimizer state's estimate leaves out per-parameter scalars (Adam's step counters: 4
# bytes per tensor); every other category is exact.
ESTIMATE_TOLERANCE = 0.05
# (model, compute dtype); "model+name": that submodule frozen before wrapping (a unit with
# no trainable parameter holds no gradient; [Note: frozen units])
CASES = [("gpt", None), ("mlp", None), ("gpt", torch.bfloat16), ("gpt+blocks.0", None)]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``: views of one buffer count it once, whole."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _model(case_kind: str) -> tuple[str, torch.nn.Module]:
    """(model kind, model) for a case's kind: "gpt", or "gpt+blocks.0" with it frozen."""
    model_kind, _, frozen = case_kind.partition("+")
    model = build_model(model_kind)
    if frozen:
        model.get_submodule(frozen).requires_grad_(False)
    return model_kind, model


def _measure(case_kind: str, stage: int, rank: int, compute_dtype, threshold=0) -> dict[str, int]:
    """Train one step and record what this rank holds, category by category."""
    model_kind, unwrapped = _model(case_kind)
    precision = shardwrap.MixedPrecision(param_dtype=compute_dtype) if compute_dtype else None
    model = shardwrap.ShardedModule(
        unwrapped,
        sharding_strategy=STAGE_STRATEGIES[stage],
        auto_wrap_policy=wrap_policy(model_kind),
        mixed_precision=precision,
        param_persistence_threshold=threshold,
    )
    optim = make_optimizer(model, "adamw")
    handles = [u.handle for u in model.units if u.handle is not None]
    peak = [0]

    def watch(handle, method: str):
        gather = getattr(handle, method)

        def gather_and_record():
            gather()
            peak[0] = max(peak[0], sum(h.full_storage_bytes for h in handles))

        setattr(handle, method, gather_and_record)

    for handle in handles:
        watch(handle, "unshard")
        watch(handle, "start_unshard")  # a prefetch allocates before the unit needs it
    # step 1 uses every parameter (TinyGPT's `extra` branch too)
    loss_for(model_kind, model, batch_for(model_kind, rank), step=1).backward()
    grads = [
        p.grad for h in handles for p in [*h.shard_params, *h.full_params] if p.grad is not None
    ]
    held_grads = _storage_bytes(grads)  # views of a kept buffer: the buffer counts whole
    optim.step()
    return {
        "parameters": _bytes(h.flat_shard for h in handles),
        "gathered_parameters": peak[0],
        "gradients": held_grads,
        "optimizer_state": _bytes(t for s in optim.state.values() for t in s.values()),
        "buffers": _bytes(model.buffers()),
    }


def _planner_worker(rank: int, world_size: int, cases=CASES, threshold: int = 0) -> list[tuple]:
    """Rows (case, stage, category, held, estimated); ``threshold``: persistence threshold."""
    rows = []
    for case_kind, compute_dtype in cases:
        for stage in STAGE_STRATEGIES:
            measured = _measure(case_kind, stage, rank, compute_dtype, threshold)
            with torch.device("meta"):  # the planner needs no real parameters
                model_kind, unwrapped = _model(case_kind)
            estimate = estimate_memory(
                unwrapped,
                world_size=world_size,
                stage=stage,
                auto_wrap_policy=wrap_policy(model_kind),
                compute_dtype=compute_dtype,
                rank=rank,
                param_persistence_threshold=threshold,
            )
            for category, held in measured.items():
                case = f"{case_kind} ({compute_dtype or 'fp32'})"
                rows.append((case, stage, category, held, estimate.bytes(category)))
    return rows


def _check(rank_rows: list[tuple]) -> None:
    for model_kind, stage, category, held, estimated in rank_rows:
        where = f"{model_kind} stage {stage} {category}: held {held}, estimated {estimated}"
        if category == "optimizer_state":
            assert estimated == pytest.approx(held, rel=ESTIMATE_TOLERANCE, abs=0), where
        else:
            assert estimated == held, where


def test_estimate_matches_bytes_held_on_one_rank(one_rank) -> None:
    _check(_planner_worker(0, 1))  # in process: one rank needs no spawn


@pytest.mark.parametrize("world_size", MULTI_RANK_WORLD_SIZES)
def test_estimate_matches_bytes_held(world_size: int) -> None:
    for rank_rows in run_ranks(_planner_worker, world_size):
        _check(rank_rows)
