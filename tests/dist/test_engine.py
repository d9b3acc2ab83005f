"""``shardwrap.initialize`` trains like a single process with the same effective batch."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.dist import engine_cases

needs_checkpoints = pytest.mark.skipif(
    importlib.util.find_spec("shardwrap.checkpoint") is None,
    reason="shardwrap.checkpoint is not in this build",
)
from tests.dist.harness import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_engine_matches_reference(world_size: int) -> None:
    results = run_ranks(engine_cases.all_cases, world_size)
    for stage, norms in results[0]["norms"].items():
        # the clipping threshold must bite at least once, or clipping went untested
        assert max(norms) > 0.5, f"stage {stage}: gradient norms {norms} never clipped"
    seen = [i for r in results for batch in r["indices"] for i in batch]
    assert sorted(seen) == list(range(24)), "ranks' loaders must split the dataset"
    sizes = {len(batch) for r in results for batch in r["indices"]}
    assert sizes <= {2} or (world_size == 3 and sizes == {2}), sizes


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_is_exact_on_one_rank(one_rank, stage: int) -> None:
    engine_cases.train_engine_and_reference(0, 1, stage=stage, accumulation=1, clipping=0.0, exact=True)


def test_engine_accumulates_and_clips_on_one_rank(one_rank) -> None:
    norms = engine_cases.train_engine_and_reference(0, 1, stage=2, accumulation=3, clipping=0.5)
    assert max(norms) > 0.5


def test_client_optimizer_on_one_rank(one_rank) -> None:
    engine_cases.train_with_client_optimizer(0, 1)


@needs_checkpoints
def test_engine_checkpoint_resumes_on_another_world_size(tmp_path) -> None:
    save_dir = str(tmp_path)
    run_ranks(engine_cases.save_then_resume, 2, save_dir, 2)
    with open(os.path.join(save_dir, "latest"), encoding="utf-8") as handle:
        assert handle.read() == "global_step2"  # the spare save did not move `latest`
    assert os.path.isdir(os.path.join(save_dir, "spare"))
    run_ranks(engine_cases.save_then_resume, 3, save_dir, 2)


@needs_checkpoints
def test_load_without_latest_starts_fresh(one_rank, tmp_path) -> None:
    engine = engine_cases.make_engine(engine_cases.build_model("gpt"), 1, 1, 0.0)
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        engine.load_checkpoint(str(tmp_path), tag="missing")
