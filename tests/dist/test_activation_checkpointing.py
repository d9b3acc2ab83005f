"""Activation checkpointing inside units and through torch's ``apply_activation_checkpointing``."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

from shardwrap.assemble.root import root_of
from tests import models
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

MODES = (
    "none",
    "inner_reentrant",
    "inner_non_reentrant",
    "wrapper_after_wrap",
    "wrapper_after_wrap_reentrant",
    "wrapper_before_wrap",
)
NUM_STEPS = 2


class CheckpointedBlock(models.Block):
    """A Block whose body runs under ``torch.utils.checkpoint`` (inside the unit's hooks)."""

    use_reentrant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=self.use_reentrant)


class ReentrantBlock(CheckpointedBlock):
    use_reentrant = True


def _apply_wrapper(model: torch.nn.Module, impl: CheckpointImpl) -> None:
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, models.Block),
    )


def _prepare(mode: str, strategy: str):
    model = build_model("gpt")
    reference = copy.deepcopy(model)
    if mode.startswith("inner"):
        cls = ReentrantBlock if mode == "inner_reentrant" else CheckpointedBlock
        for block in model.blocks:
            block.__class__ = cls
    if mode == "wrapper_before_wrap":  # the reference needs the same parameter names
        _apply_wrapper(model, CheckpointImpl.NO_REENTRANT)
        _apply_wrapper(reference, CheckpointImpl.NO_REENTRANT)
    sharded = wrap_case(model, Case(strategy=strategy))
    if mode.startswith("wrapper_after_wrap"):
        reentrant = mode.endswith("reentrant")
        _apply_wrapper(
            sharded, CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
        )
    return sharded, reference


def _train(rank: int, world_size: int, strategy: str, mode: str) -> int:
    sharded, reference = _prepare(mode, strategy)
    kind = "adamw"  # reorder-safe: the bound of tests/tolerances.py
    optim, ref_optim = make_optimizer(sharded, kind), make_optimizer(reference, kind)
    gathers = []
    for step in range(NUM_STEPS):
        batches = [batch_for("gpt", 1000 * step + r) for r in range(world_size)]
        loss_for("gpt", reference, concat(batches), step).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        sharded.comm_ledger.reset()
        loss_for("gpt", sharded, batches[rank], step).backward()
        gathers.append(sharded.comm_ledger.count("all_gather", "params"))
        optim.step()
        optim.zero_grad()
        check_shards(sharded, reference, exact=False, tol=reordered_param_tol(step + 1))
    return gathers[-1]


def checkpointing_worker(rank: int, world_size: int) -> dict:
    return {(s, m): _train(rank, world_size, s, m) for s in STRATEGIES for m in MODES}


# Gathers in one training step (forward + backward) of TinyGPT with 3 units (root + 2
# blocks, only the blocks checkpointed), as documented in docs/training.md. FULL_SHARD:
# the last block stays gathered from forward into backward (a step after the first).
EXPECTED_GATHERS = {
    "FULL_SHARD": {"plain": 5, "reentrant_wrapper": 7},
    "SHARD_GRAD_OP": {"plain": 3, "reentrant_wrapper": 5},
    "SHARD_OPTIM": {"plain": 3, "reentrant_wrapper": 3},
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_activation_checkpointing_parity(world_size):
    results = run_ranks(checkpointing_worker, world_size)
    for (strategy, mode), gathers in results[0].items():
        if world_size == 1 or strategy == "NO_SHARD":
            assert gathers == 0, (strategy, mode)
            continue
        kind = "reentrant_wrapper" if mode == "wrapper_after_wrap_reentrant" else "plain"
        assert gathers == EXPECTED_GATHERS[strategy][kind], (strategy, mode, gathers)


def _prefetch_worker(rank: int, world_size: int, mode: str) -> list[str]:
    """Units the step runtime prefetched during the second step's backward."""
    sharded, _ = _prepare(mode, "FULL_SHARD")
    runtime = root_of(sharded).runtime
    prefetched: list[str] = []
    issue = runtime._prefetch

    def recording_prefetch(unit, upcoming):
        prefetched.append(unit.name)
        issue(unit, upcoming)

    runtime._prefetch = recording_prefetch
    for step in range(NUM_STEPS):
        loss = loss_for("gpt", sharded, batch_for("gpt", rank), step)
        prefetched.clear()
        loss.backward()
    return prefetched


@pytest.mark.parametrize("mode", ["none", "wrapper_after_wrap_reentrant"])
def test_backward_prefetches_units_a_reentrant_checkpoint_runs_again(mode: str) -> None:
    # A reentrant wrapper runs the whole unit without grad, so no output hook marks it as
    # reached by backward; it is recomputed there all the same and so still prefetched
    # ([Note: frozen units] in shardwrap/hooks.py), in backward order.
    for prefetched in run_ranks(_prefetch_worker, 2, mode):
        assert prefetched == ["blocks.1", "blocks.0"], prefetched
