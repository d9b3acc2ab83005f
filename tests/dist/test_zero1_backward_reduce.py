"""ZeRO-1 reduces each unit's gradients during backward, and only outside ``no_sync``.

See [Note: ZeRO-1 reduces in backward] in ``shardwrap/runtime/step.py``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest

from tests import models
from tests.dist.harness import run_ranks
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


def _scatters(model) -> int:
    return model.comm_ledger.count("reduce_scatter", "grads")


def _order_worker(rank: int, world_size: int) -> dict:
    model = wrap_case(build_model("gpt"), Case(strategy="SHARD_OPTIM"))
    optim = make_optimizer(model, "adamw")
    first_block = next(u.module for u in model.units if isinstance(u.module, models.Block))
    seen_mid_backward: list[int] = []

    def note_scatters_when_block_input_grad_arrives(module, args):
        # Fires in backward before the first block's own reduction: later units' are issued.
        args[0].register_hook(lambda grad: seen_mid_backward.append(_scatters(model)))

    first_block.register_forward_pre_hook(note_scatters_when_block_input_grad_arrives)
    result: dict = {"num_units": sum(u.handle is not None for u in model.units)}
    for phase, sync in (("sync", True), ("no_sync", False), ("after_no_sync", True)):
        model.comm_ledger.reset()
        with contextlib.nullcontext() if sync else model.no_sync():
            loss_for("gpt", model, batch_for("gpt", rank), step=0).backward()
        result[phase] = {
            "mid_backward": seen_mid_backward.pop(),
            "after_backward": _scatters(model),
            "full_grads_left": sum(
                p.grad is not None for u in model.units for p in u.handle.full_params
            ),
        }
        if sync:
            model.comm_ledger.reset()
            optim.step()
            optim.zero_grad()
            result[phase]["at_step"] = _scatters(model)
    return result


def test_reduce_scatters_are_issued_during_backward_outside_no_sync() -> None:
    for result in run_ranks(_order_worker, 2):
        units = result["num_units"]
        for phase in ("sync", "after_no_sync"):
            counts = result[phase]
            assert counts["mid_backward"] >= 1, (phase, counts)  # overlapped with backward
            assert counts["after_backward"] == units, (phase, counts)
            assert counts["at_step"] == 0, (phase, counts)  # nothing left for the step
            assert counts["full_grads_left"] == 0, (phase, counts)  # freed once reduced
        quiet = result["no_sync"]
        assert quiet["mid_backward"] == quiet["after_backward"] == 0, quiet
        assert quiet["full_grads_left"] > 0, quiet  # accumulated locally instead


def _no_sync_then_step_worker(rank: int, world_size: int, finish_in_sync: bool) -> int:
    """Micro-batches under ``no_sync``; the last one synchronises, or none does."""
    model = build_model("gpt")
    reference = copy.deepcopy(model)
    sharded = wrap_case(model, Case(strategy="SHARD_OPTIM"))
    kind = "adamw"  # reorder-safe: the bound of tests/tolerances.py
    optim, ref_optim = make_optimizer(sharded, kind), make_optimizer(reference, kind)
    num_micro = 3
    step_scatters = 0
    for step in range(2):
        micro = [[batch_for("gpt", 100 * step + 10 * r + k) for k in range(num_micro)] for r in
                 range(world_size)]  # fmt: skip
        every = [b for per_rank in micro for b in per_rank]
        loss_for("gpt", reference, concat(every), step).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        for k, batch in enumerate(micro[rank]):
            sync = finish_in_sync and k == num_micro - 1
            with contextlib.nullcontext() if sync else sharded.no_sync():
                (loss_for("gpt", sharded, batch, step) / num_micro).backward()
        sharded.comm_ledger.reset()
        optim.step()  # without a synchronising backward, this step's pre-hook reduces
        step_scatters += _scatters(sharded)
        optim.zero_grad()
        check_shards(sharded, reference, exact=False, tol=reordered_param_tol(step + 1))
    return step_scatters


@pytest.mark.parametrize("finish_in_sync", [True, False])
def test_no_sync_accumulation_matches_big_batch(finish_in_sync: bool) -> None:
    for step_scatters in run_ranks(_no_sync_then_step_worker, 2, finish_in_sync):
        if finish_in_sync:
            assert step_scatters == 0
        else:
            assert step_scatters > 0  # the leftovers are reduced at the step, not dropped
