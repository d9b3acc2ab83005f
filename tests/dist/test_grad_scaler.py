"""fp16 with ShardedGradScaler against torch.amp.GradScaler on a low-precision reference."""

from __future__ import annotations

import copy

import pytest
import torch

import shardwrap
from shardwrap.policies import ModuleWrapPolicy
from shardwrap.runtime.step import reduce_deferred_grads_for
from tests.dist.harness import STRATEGIES, WORLD_SIZES, run_ranks
from tests.dist.parity import (
    PARITY_GRAD_SCALE,
    SGD,
    WEIGHT_DECAY,
    batch_for,
    build_model,
    check_shards,
    concat,
    loss_for,
    make_optimizer,
)
from tests.dist.test_mixed_precision import BF16_ROUNDINGS, LowPrecisionReference
from tests.tolerances import (
    FP16_UNIT_ROUNDOFF,
    low_precision_relative,
    reordered_sgd_param_atol,
    step_rounding_rtol,
)

FP16 = shardwrap.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
# Starts high enough that the first steps overflow and the scale backs off (2**17, 2**16
# overflow fp16's 65504 in the loss gradient), then grows every 2 clean steps.
INIT_SCALE = 2.0**17
GROWTH_INTERVAL = 2
NUM_STEPS = 6


def fp16_param_tol(applied_steps: int) -> dict[str, float]:
    """As for bf16 (test_mixed_precision.bf16_param_tol, the same chain of TinyGPT's
    rounded ops) with fp16's 11-bit significand: parity's SGD bound at
    ``low_precision_relative(BF16_ROUNDINGS, 2**-11)`` over the steps the scalers applied
    (skipped steps move neither run), and each applied step's fp32 rounding. Measured
    at 3 ranks: 5.7e-4 after 3 applied steps (bound 4.5e-3); control: the sharded loss
    doubled put the parameters 3.0e-2 to 7.3e-2 apart after the first applied step
    (bound 7.9e-4), besides putting the scales out of step."""
    if applied_steps == 0:
        return {"rtol": 0.0, "atol": 0.0}
    relative = low_precision_relative(BF16_ROUNDINGS, FP16_UNIT_ROUNDOFF)
    atol = reordered_sgd_param_atol(
        applied_steps, **SGD, weight_decay=WEIGHT_DECAY, relative=relative,
        grad_scale=PARITY_GRAD_SCALE,
    )  # fmt: skip
    return {"rtol": step_rounding_rtol(applied_steps), "atol": atol}


def _wrap(model, strategy):
    return shardwrap.ShardedModule(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}),
        mixed_precision=FP16,
    )


def _fp16_run(rank: int, world_size: int, strategy: str) -> list[float]:
    master = build_model("gpt")
    reference = LowPrecisionReference(copy.deepcopy(master), torch.float16, FP16)
    sharded = _wrap(master, strategy)
    optim, ref_optim = make_optimizer(sharded, "sgd"), make_optimizer(reference.master, "sgd")
    kwargs = {"init_scale": INIT_SCALE, "growth_interval": GROWTH_INTERVAL}
    scaler = shardwrap.ShardedGradScaler(**kwargs)
    ref_scaler = torch.amp.GradScaler("cpu", **kwargs)
    scales, applied = [], 0
    for step in range(NUM_STEPS):
        batches = [batch_for("gpt", 1000 * step + r) for r in range(world_size)]
        reference.refresh()
        reference.backward(ref_scaler.scale(loss_for("gpt", reference.low, concat(batches), 0)))
        ref_scaler.step(ref_optim)
        before = ref_scaler.get_scale()
        ref_scaler.update()
        applied += ref_scaler.get_scale() >= before  # backed off: an inf, the step skipped
        ref_optim.zero_grad()
        scaler.scale(loss_for("gpt", sharded, batches[rank], 0)).backward()
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale())
        tol = fp16_param_tol(applied)
        check_shards(sharded, reference.master, exact=world_size == 1, tol=tol)
        scales.append(scaler.get_scale())
    return scales


def _inf_on_one_rank(rank: int, world_size: int, strategy: str) -> tuple[float, bool]:
    sharded = _wrap(build_model("gpt"), strategy)
    optim = make_optimizer(sharded, "sgd")
    scaler = shardwrap.ShardedGradScaler(init_scale=2.0**8)
    before = [p.detach().clone() for p in sharded.parameters()]
    scaler.scale(loss_for("gpt", sharded, batch_for("gpt", rank), 0)).backward()
    reduce_deferred_grads_for(optim)  # a no-op: every strategy reduced in backward
    if rank == world_size - 1:
        grad = next(p.grad for p in sharded.parameters() if p.grad is not None and p.numel())
        grad.view(-1)[0] = float("inf")
    scaler.step(optim)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, sharded.parameters()))
    return scaler.get_scale(), unchanged


def scaler_worker(rank: int, world_size: int) -> dict:
    result = {}
    for strategy in STRATEGIES:
        result[strategy] = _fp16_run(rank, world_size, strategy)
        result[strategy, "inf"] = _inf_on_one_rank(rank, world_size, strategy)
    return result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fp16_scaler_matches_torch_and_skips_together(world_size):
    results = run_ranks(scaler_worker, world_size)
    for per_rank in results:
        for strategy in STRATEGIES:
            scales = per_rank[strategy]
            assert scales == results[0][strategy]
            assert min(scales) < INIT_SCALE, "the run must exercise a skipped step"
            assert per_rank[strategy, "inf"] == (2.0**7, True), (strategy, per_rank)
