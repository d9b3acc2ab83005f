"""torch.compile with shardwrap: compiled blocks inside units, and a compiled whole model.

One rank pool runs every case (the inductor compile costs seconds on 2 cores, and the
compiled block is reused by every later model of the same shape): each strategy's run
with compiled blocks must equal torch FSDP2's run with the same compiled blocks bit for
bit, with no graph break and no recompile after step 2. Against eager training the
compiled kernels differ by rounding only: :func:`compiled_vs_eager_tol`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch

import shardwrap
from tests import tolerances
from tests.dist import compile_cases as cc
from tests.dist import harness, parity
from tests.dist.harness import STRATEGIES, run_ranks
from tests.dist.parity import check_shards, max_shard_difference

WORLD_SIZE = 2
COMPILE_TIMEOUT_S = 900.0
INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
# Each strategy, hybrid, and blocks compiled after wrapping instead of before.
COMPILED_RUNS = [*STRATEGIES, "HYBRID_SHARD", "after_wrap"]


def compiled_vs_eager_tol(largest_param: float, clipped: bool = False) -> float:
    """The largest parameter difference allowed between compiled and eager training after
    ``cc.NUM_STEPS`` steps of SGD (``cc.LR``, momentum 0.9) of TinyGPT on 2 ranks.

    Inductor fuses pointwise ops into its reductions and vectorises them in another order,
    and its vectorised exp/tanh are within an ulp or so of eager's: each gradient is the
    same chain of sums in another order, so the SGD bound of tests/tolerances.py holds
    (``reordered_sgd_param_atol`` on parity's TinyGPT sums and gradient scale; the
    batches here are random tokens as parity's), plus the rounding of ``p - update`` each
    step (``step_rounding_rtol`` of ``largest_param``). ``clipped``: the gradients were
    clipped to ``cc.CLIP_NORM`` (``tolerances.clipped_grad_multiple``). About 8e-6;
    measured: compiled vs eager 1e-7 to 5e-7; a real error (a missing reduction, a stale
    weight) moves parameters by lr * |gradient|, O(1e-2) here."""
    relative = parity.reordered_relative(parity.batch_terms("gpt", WORLD_SIZE))
    scale = parity.PARITY_GRAD_SCALE
    if clipped:
        numel = parity.trainable_numel(parity.build_model("gpt"))
        scale *= tolerances.clipped_grad_multiple(numel, cc.CLIP_NORM, relative, scale)
    atol = tolerances.reordered_sgd_param_atol(
        cc.NUM_STEPS, lr=cc.LR, momentum=0.9, relative=relative, grad_scale=scale
    )
    return atol + tolerances.step_rounding_rtol(cc.NUM_STEPS) * largest_param


def _all_cases(rank: int, world_size: int) -> dict:
    # compile in this process: a pool of compile workers would outlive the test's ranks
    torch._inductor.config.compile_threads = 1
    results: dict = {}
    fsdp2_eager, fsdp2_eager_params = cc.torch_fsdp2(compile_blocks=False)
    fsdp2, fsdp2_params = cc.torch_fsdp2(compile_blocks=True)
    results["fsdp2_vs_eager"] = _difference(fsdp2_params, fsdp2_eager_params)
    results["largest_param"] = max(float(p.abs().max()) for p in fsdp2_eager_params.parameters())
    results["fsdp2"] = fsdp2
    runs = {strategy: cc.shardwrap_run(strategy, compile_blocks=True) for strategy in STRATEGIES}
    # two replicas of one-rank shards: the reduction is a 2-term all-reduce, as FSDP2's
    hybrid = {"process_group": shardwrap.hybrid_process_groups(1)}
    runs["HYBRID_SHARD"] = cc.shardwrap_run("HYBRID_SHARD", compile_blocks=True, **hybrid)
    runs["after_wrap"] = cc.shardwrap_run("FULL_SHARD", compile_blocks=True, after_wrap=True)
    for name, (run, sharded) in runs.items():
        check_shards(sharded, fsdp2_params, exact=True)
        results[name] = run
        results[f"{name}_vs_eager"] = max_shard_difference(sharded, fsdp2_eager_params)
    whole, sharded = cc.whole_model_run()
    results["whole"] = whole
    results["whole_vs_eager"] = max_shard_difference(sharded, fsdp2_eager_params)
    results.update(_features(rank, runs["FULL_SHARD"]))
    return {name: _portable(value) for name, value in results.items()}


def _features(rank: int, full_shard) -> dict:
    """Activation checkpointing, bf16, no_sync, clipping, the ledger, checkpoints."""
    results = {}
    variants = {
        "checkpointed": cc.Variant(checkpointed=True),
        "bf16": cc.Variant(param_dtype=torch.bfloat16),
    }
    for name, variant in variants.items():
        reference, reference_params = cc.torch_fsdp2(True, variant)
        run, sharded = cc.shardwrap_run("FULL_SHARD", True, variant)
        check_shards(sharded, reference_params, exact=True)
        results[name] = (run.losses, reference.losses)
    accumulate = cc.Steps(microbatches=2, no_sync=cc.fsdp2_no_sync)
    reference, reference_params = cc.torch_fsdp2(True, steps=accumulate)
    accumulate = cc.Steps(microbatches=2, no_sync=lambda model: model.no_sync())
    run, sharded = cc.shardwrap_run("FULL_SHARD", True, steps=accumulate)
    check_shards(sharded, reference_params, exact=True)
    results["no_sync"] = (run.losses, reference.losses)
    reference, reference_params = cc.torch_fsdp2(True, steps=cc.Steps(clip=cc.clip_torch))
    run, sharded = cc.shardwrap_run("FULL_SHARD", True, steps=cc.Steps(clip=cc.clip_shardwrap))
    results["clip_vs_torch"] = max_shard_difference(sharded, reference_params)
    results["clip_moved"] = max_shard_difference(sharded, cc.torch_fsdp2(True)[1])
    run, sharded = full_shard
    for name, compiled in (("ledger_wire_compiled", True), ("ledger_wire_eager", False)):
        results[name] = cc.ledger_and_wire(cc.shardwrap_model("FULL_SHARD", compiled), rank)
    cc.checkpoint_round_trip(run, sharded, "FULL_SHARD")
    return results


def _portable(value):
    # a Run goes back to the test process without its optimizer
    return dataclasses.replace(value, optimizer=None) if isinstance(value, cc.Run) else value


def _difference(a, b) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in pairs)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    # Fresh ranks: inductor leaves its compile threads running, which a pooled rank must
    # not. The compiles (five graphs) take minutes on 2 loaded cores, past the usual limit.
    # A private inductor cache, so the verdict never rests on kernels another process cached
    # (other tests, benchmarks, another ATEN_CPU_CAPABILITY): torch's FX graph cache key has
    # left out settings C++ kernels are specialised on (the thread count: pytorch/pytorch
    # #167463, fixed by #184444). With the shared cache under ATEN_CPU_CAPABILITY=avx2 the
    # comparison here failed on NaN in 3 runs of 3; with a private cache it passed.
    previous, harness.RANK_TIMEOUT_S = harness.RANK_TIMEOUT_S, COMPILE_TIMEOUT_S
    previous_cache = os.environ.get(INDUCTOR_CACHE_VAR)
    with tempfile.TemporaryDirectory(prefix="shardwrap-inductor-") as cache:
        os.environ[INDUCTOR_CACHE_VAR] = cache  # fresh ranks start with this environment
        try:
            return run_ranks(_all_cases, WORLD_SIZE, fresh=True)
        finally:
            harness.RANK_TIMEOUT_S = previous
            if previous_cache is None:
                os.environ.pop(INDUCTOR_CACHE_VAR, None)
            else:
                os.environ[INDUCTOR_CACHE_VAR] = previous_cache


@pytest.mark.parametrize("strategy", COMPILED_RUNS)
def test_compiled_blocks_match_torch_fsdp2_bit_for_bit(results, strategy: str) -> None:
    # check_shards(exact=True) ran on every rank after training; the losses agree too
    for per_rank in results:
        assert per_rank[strategy].losses == per_rank["fsdp2"].losses


@pytest.mark.parametrize("strategy", COMPILED_RUNS)
def test_compiled_blocks_have_no_graph_break_and_no_recompile(results, strategy: str) -> None:
    # error_on_recompile was on from step 2; fullgraph=True refuses any graph break, and
    # the counter shows none was even attempted
    for per_rank in results:
        assert per_rank[strategy].graph_breaks == 0
        assert per_rank[strategy].losses[-1] < per_rank[strategy].losses[0]


@pytest.mark.parametrize("strategy", COMPILED_RUNS)
def test_compiled_blocks_match_eager_within_rounding(results, strategy: str) -> None:
    for per_rank in results:
        tol = compiled_vs_eager_tol(per_rank["largest_param"])
        assert per_rank["fsdp2_vs_eager"] <= tol
        assert per_rank[f"{strategy}_vs_eager"] <= tol


def test_compiled_whole_model_trains_at_parity(results) -> None:
    for per_rank in results:
        whole = per_rank["whole"]
        # Dynamo compiled frames of it, breaking the graph at the units' hooks
        assert whole.frames_compiled >= 1 and whole.graph_breaks >= 1
        assert per_rank["whole_vs_eager"] <= compiled_vs_eager_tol(per_rank["largest_param"])


@pytest.mark.parametrize("feature", ["checkpointed", "bf16", "no_sync"])
def test_compiled_blocks_with_feature_match_torch_fsdp2(results, feature: str) -> None:
    # check_shards(exact=True) against torch FSDP2 with the same feature ran on every rank
    for per_rank in results:
        losses, reference_losses = per_rank[feature]
        assert losses == reference_losses


def test_compiled_blocks_clip_as_torch_clips(results) -> None:
    for per_rank in results:
        tol = compiled_vs_eager_tol(per_rank["largest_param"], clipped=True)
        assert per_rank["clip_vs_torch"] <= tol
        # and clipping did change the run: the unclipped run is far from it
        assert per_rank["clip_moved"] > 100 * tol


def test_compiled_blocks_ledger_equals_wire(results) -> None:
    for per_rank in results:
        ledger, wire = per_rank["ledger_wire_compiled"]
        assert ledger == wire > 0
        assert per_rank["ledger_wire_eager"] == (ledger, wire)
