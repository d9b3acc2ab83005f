"""``shardwrap.initialize`` trains like a single process with the same effective batch."""

from __future__ import annotations

import pytest

from tests.dist import engine_cases
from tests.dist.harness import run_ranks


# 3 ranks force padding; 2 ranks train in test_engine_checkpoint.py.
@pytest.mark.parametrize("world_size", [3])
def test_engine_matches_reference(tmp_path, world_size: int) -> None:
    results = run_ranks(engine_cases.all_cases, world_size, str(tmp_path))
    for stage, norms in results[0]["norms"].items():
        # the clipping threshold must bite at least once, or clipping went untested
        assert max(norms) > 0.5, f"stage {stage}: gradient norms {norms} never clipped"
    seen = [i for r in results for batch in r["indices"] for i in batch]
    assert sorted(seen) == list(range(24)), "ranks' loaders must split the dataset"
    sizes = {len(batch) for r in results for batch in r["indices"]}
    assert sizes == {engine_cases.MICRO_BATCH}, sizes


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_is_exact_on_one_rank(one_rank, stage: int) -> None:
    engine_cases.train_engine_and_reference(
        0, 1, stage=stage, accumulation=1, clipping=0.0, exact=True
    )


def test_engine_accumulates_and_clips_on_one_rank(one_rank) -> None:
    norms = engine_cases.train_engine_and_reference(0, 1, stage=2, accumulation=3, clipping=0.5)
    assert max(norms) > 0.5


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_engine_on_one_rank(one_rank, stage: int) -> None:
    engine_cases.bf16_engine_equals_sharded_module(0, 1, stage)


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_engine_on_one_rank(one_rank, stage: int) -> None:
    engine_cases.fp16_engine_equals_manual_scaling(0, 1, stage)


def test_client_optimizer_on_one_rank(one_rank) -> None:
    engine_cases.train_with_client_optimizer(0, 1)


@pytest.mark.parametrize("stage", [1, 3])
def test_nvme_offload_engine_on_one_rank(one_rank, tmp_path, stage: int) -> None:
    engine_cases.nvme_engine_equals_memory_engine(0, 1, str(tmp_path), stage)


def test_nvme_param_offload_streams_the_step(one_rank, tmp_path) -> None:
    """offload_param and offload_optimizer nvme with one path, sub_group_size 1000."""
    engine_cases.nvme_engine_equals_memory_engine(
        0, 1, str(tmp_path), 3, offload=("param", "optimizer")
    )
    engine_cases.nvme_engine_equals_memory_engine(0, 1, str(tmp_path), 3, offload=("param",))
