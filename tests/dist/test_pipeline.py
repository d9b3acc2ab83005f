"""ZeRO inside pipeline stages: torch's schedules over ShardedModule stages (PP2 x DP2).

Every case trains the tiny MLP of ``pipeline_cases`` for 5 AdamW steps of 4 microbatches
per data-parallel rank and is checked against single-process training on the same global
batch (losses every step, full parameters at the end; within bounds on float32 rounding,
the batch being summed in parts: tests/tolerances.py). The
ledger shows one gradient reduction per unit and step (after the last microbatch's
backward), and how often ZeRO-3 parameters are gathered with and without keeping them.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import pipeline_cases as pc
from tests.dist.harness import run_ranks
from tests.tolerances import (
    REORDERED_GRAD_TOL,
    check_losses,
    reordered_loss_atols,
    reordered_param_tol,
)

PP, WORLD = 2, 4
CASES = [
    (strategy, schedule, False)
    for strategy in ("SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD")
    for schedule in ("gpipe", "1f1b")
] + [("FULL_SHARD", "interleaved", False), ("FULL_SHARD", "gpipe", True)]


@pytest.fixture(scope="module")
def results():
    return run_ranks(pc.pipeline_worker, WORLD, PP, CASES)


@pytest.fixture(scope="module")
def reference():
    return pc.reference_run(WORLD // PP)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_pipeline_matches_single_process(results, reference, case):
    ref_losses, ref_params, grad_l1s = reference
    largest = max(float(p.abs().max()) for p in ref_params.values())
    # each step's loss: its own rounding and the drift of the steps before it
    loss_atols = reordered_loss_atols(ref_losses, grad_l1s, largest, reordered_param_tol)
    seen: set[str] = set()
    for rank, by_case in enumerate(results):
        out = by_case[case]
        if rank // (WORLD // PP) == PP - 1:  # the last stage computes the losses
            check_losses(out["losses"], ref_losses, loss_atols, f"rank {rank}")
        for name, value in out["final"].items():
            torch.testing.assert_close(
                value,
                ref_params[name],
                msg=lambda m, n=name: f"{n}: {m}",
                **reordered_param_tol(pc.NUM_STEPS),
            )
            seen.add(name)
    assert seen == set(ref_params)  # the stages together hold the whole model


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_one_gradient_reduction_per_unit_and_step(results, case):
    for by_case in results:
        for step_counts in by_case[case]["counts"]:
            for stage in step_counts:
                assert stage["units"], stage
                assert stage["grad_reductions"] == {u: 1 for u in stage["units"]}, stage
                assert stage["presence_votes"] == 1, stage


def test_zero3_gathers_per_step(results):
    """ZeRO-3 by default gathers for every microbatch's forward (FSDP2 under these
    schedules), and keeps units from the first backward to the last; with
    ``set_reshard_after_forward(False, root_only=False)`` once per unit and step."""
    for by_case in results:
        default = by_case[("FULL_SHARD", "gpipe", False)]["counts"]
        kept = by_case[("FULL_SHARD", "gpipe", True)]["counts"]
        for step in range(1, pc.NUM_STEPS):  # step 0 has no forward order to go by yet
            (d,), (k,) = default[step], kept[step]
            units = len(k["units"])
            assert k["gathers"] == units, k
            assert units < d["gathers"] <= units * (pc.NUM_MICROBATCHES + 1), d
            assert d["gather_bytes"] > k["gather_bytes"]


def test_controls_for_hand_written_accumulation():
    """FSDP2's pattern (``set_requires_gradient_sync(False)`` and
    ``set_reshard_after_backward(False)`` on all micro-batches but the last): the same
    gradients as one big batch, and fewer all-gathers in the second micro-batch (its
    forward finds the units still gathered; 3 instead of 7 when measured)."""
    for by_keep in run_ranks(pc.accumulation_worker, 2):
        for _keep, out in by_keep.items():
            for name, grad in out["reference"].items():
                torch.testing.assert_close(
                    out["full_grads"][name], grad, msg=name, **REORDERED_GRAD_TOL
                )
        assert by_keep[True]["gathers"] < by_keep[False]["gathers"], by_keep
