"""Checkpoints saved at one world size and strategy load at others; training continues.

One chain of spawned runs: each phase loads the previous phase's checkpoint under a new
world size and strategy, checks every local piece (parameters and AdamW state) bit for bit
against what the saving run held, trains on next to an unsharded reference started from
exactly that state, and saves again for the next phase.
"""

from __future__ import annotations

from tests.dist.ckpt_workers import STEPS_PER_PHASE, assemble, phase
from tests.dist.harness import run_ranks

# Loads into SHARD_GRAD_OP and NO_SHARD run in test_checkpoint_crash.py (saves from
# SHARD_GRAD_OP in test_consolidate.py): those spawn anyway, and this chain stays short.
# The last phase, at one rank, continues bit for bit like its reference.
CHAIN = [
    (2, "FULL_SHARD"),
    (3, "SHARD_OPTIM"),
    (4, "HYBRID_SHARD"),
    (1, "FULL_SHARD"),
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
