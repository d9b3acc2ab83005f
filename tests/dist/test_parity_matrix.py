"""Every strategy x every torch optimizer implementation, 10 steps, against DDP.

Each optimizer is built by the user's own call (``benchmarks/optimizers.py``: for-loop,
foreach and fused AdamW/Adam/SGD/Adagrad, RMSprop, weight decay on and off, per-parameter
groups) on the wrapped model. Losses of every step and the full parameters after the last
step are compared with DDP's in the same ranks:

* at 2 ranks bit for bit: a sum of two terms is the same in any order, so DDP's
  all-reduce and our reduce-scatter (or one-rank-shard hybrid all-reduce) agree exactly;
* the hybrids with 2 x 2 ranks reduce in two stages, in another order than DDP's ring, so
  there within ``torch.testing.assert_close``'s float32 defaults (RMSprop: see
  ``RMSPROP_TOLERANCE``).

One spawned set of ranks runs every configuration in turn.
"""

from __future__ import annotations

import torch

import shardwrap
from benchmarks import gpt
from benchmarks.optimizers import OPTIMIZERS
from benchmarks.parity import FLOAT32_TOLERANCE, differences, train
from tests.dist.harness import run_ranks

NUM_STEPS = 10
CONFIG = gpt.GPTConfig(vocab=64, dim=32, depth=2, num_heads=4, seq=16)
FLAT_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM", "NO_SHARD")
HYBRIDS = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# RMSprop has no bias correction: its first steps divide each gradient element by about
# sqrt(1 - alpha) = 0.1 of its own magnitude, so every element moves by ~10 lr however
# small its gradient. A last-bit difference from another summation order in an element
# whose gradient is near zero thus changes that element's update by up to that much;
# measured: 1.9e-5 after 10 steps (Adam's bias-corrected steps stay within the defaults).
RMSPROP_TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-4}


def _tolerance(optimizer: str, exact: bool) -> dict[str, float] | None:
    if exact:
        return None
    return RMSPROP_TOLERANCE if optimizer.startswith("rmsprop") else FLOAT32_TOLERANCE


def _matrix_worker(rank: int, world_size: int, strategies, hybrid_shard_size: int, exact: bool):
    failures = []
    for name, make_optimizer in OPTIMIZERS.items():
        reference = train(CONFIG, "DDP", make_optimizer, num_steps=NUM_STEPS)
        for strategy in strategies:
            run = train(
                CONFIG,
                strategy,
                make_optimizer,
                num_steps=NUM_STEPS,
                hybrid_shard_size=hybrid_shard_size,
            )
            found = differences(run, reference, tolerance=_tolerance(name, exact))
            if found:
                failures.append(f"{strategy} x {name}: " + "; ".join(found[:3]))
        assert reference.losses[-1] < reference.losses[0], f"{name}: DDP did not train"
    return failures


def test_every_strategy_and_optimizer_equals_ddp_bit_for_bit() -> None:
    # Hybrids with one-rank shard groups: the replica all-reduce carries the whole sum.
    strategies = FLAT_STRATEGIES + HYBRIDS
    failures = run_ranks(_matrix_worker, 2, strategies, 1, True)
    assert failures[0] == failures[1]
    assert not failures[0], "\n".join(failures[0])


def test_hybrids_on_two_by_two_ranks_match_ddp() -> None:
    failures = run_ranks(_matrix_worker, 4, HYBRIDS, 2, False)
    assert not failures[0], "\n".join(failures[0])


def _kept_copy_worker(rank: int, world_size: int) -> list[str]:
    # Under mixed precision every strategy keeps a low-precision gathered copy at some
    # point (NO_SHARD and ZeRO-1 across the step). Fused SGD bumps no version counter, yet
    # its updates equal the for-loop's bit for bit, so the runs must agree exactly.
    precision = shardwrap.MixedPrecision(param_dtype=torch.bfloat16)
    failures = []
    for strategy in FLAT_STRATEGIES:
        runs = {
            name: train(
                CONFIG,
                strategy,
                OPTIMIZERS[name],
                num_steps=NUM_STEPS,
                mixed_precision=precision,
            )
            for name in ("sgd_momentum_loop", "sgd_momentum_fused")
        }
        found = differences(runs["sgd_momentum_fused"], runs["sgd_momentum_loop"], tolerance=None)
        if found:
            failures.append(f"{strategy}: " + "; ".join(found[:3]))
    return failures


def test_mixed_precision_copies_follow_fused_steps() -> None:
    failures = run_ranks(_kept_copy_worker, 2)
    assert not failures[0], "\n".join(failures[0])
