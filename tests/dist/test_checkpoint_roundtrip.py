"""Checkpoints saved at one world size and strategy load at others; training continues.

One chain of spawned runs: each phase loads the previous phase's checkpoint under a new
world size and strategy, checks every local piece (parameters and AdamW state) bit for bit
against what the saving run held, trains on next to an unsharded reference started from
exactly that state, and saves again for the next phase.
"""

from __future__ import annotations

from tests.dist.ckpt_workers import STEPS_PER_PHASE, assemble, phase
from tests.dist.harness import run_ranks

# Loads at world size 1 and into SHARD_GRAD_OP run in test_checkpoint_crash.py and
# test_checkpoint_errors.py (and saves from SHARD_GRAD_OP in test_consolidate.py), which
# spawn anyway; this chain keeps to the other strategies to stay short.
CHAIN = [
    (2, "FULL_SHARD"),
    (3, "SHARD_OPTIM"),
    (4, "HYBRID_SHARD"),
    (2, "NO_SHARD"),
]


def test_resume_across_world_sizes_and_strategies(tmp_path):
    snapshot = None
    previous = None
    for number, (world_size, strategy) in enumerate(CHAIN):
        target = str(tmp_path / f"ckpt{number}")
        pieces = run_ranks(
            phase, world_size, strategy, previous, target, snapshot, number * STEPS_PER_PHASE
        )
        snapshot = assemble(pieces)
        previous = target
