"""CPUOffload(offload_params=True): host shards and a CPU optimizer step, exact on CPU.

See [Note: host shards and staging] in ``shardwrap/offload/host.py``.
"""

from __future__ import annotations

import pytest

from tests.dist import offload_cases
from tests.dist.harness import STRATEGIES, run_ranks


def test_every_stage_and_bf16_match_training_without_offload() -> None:
    results = run_ranks(offload_cases.strategies, 2)
    for losses in results:  # every case ran all its steps (the checks are in the worker)
        assert sorted(losses) == sorted(offload_cases.STRATEGY_CASES)
        assert all(len(steps) == offload_cases.NUM_STEPS for steps in losses.values())


def test_checkpoint_and_engine_offload(tmp_path) -> None:
    run_ranks(offload_cases.checkpoint_and_engine, 2, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_rank_is_bit_exact_with_the_reference(one_rank, strategy: str) -> None:
    offload_cases.offload_matches_plain(0, 1, strategy)
