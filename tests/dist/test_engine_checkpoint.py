"""Engine checkpoints: ``tag``, ``latest``, and resuming on another world size and stage."""

from __future__ import annotations

import os

import pytest

from tests.dist import engine_cases
from tests.dist.harness import run_ranks


def test_engine_checkpoint_resumes_on_another_world_size(tmp_path) -> None:
    save_dir = str(tmp_path)
    run_ranks(engine_cases.save_then_resume, 2, save_dir, 2)
    with open(os.path.join(save_dir, "latest"), encoding="utf-8") as handle:
        assert handle.read() == "global_step2"  # the spare save did not move `latest`
    assert os.path.isdir(os.path.join(save_dir, "spare"))
    run_ranks(engine_cases.save_then_resume, 3, save_dir, 2)


def test_load_without_latest_starts_fresh(one_rank, tmp_path) -> None:
    engine = engine_cases.make_engine(engine_cases.build_model("gpt"), 1, 1, 0.0)
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        engine.load_checkpoint(str(tmp_path), tag="missing")
