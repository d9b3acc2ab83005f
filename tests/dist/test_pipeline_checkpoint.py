"""Checkpoints under PP x DP hold the whole model under its own names.

Saved by PP2 x DP2 stages (each stage contributes its own parameters and optimizer
state), a checkpoint loads under plain data parallelism at another world size (and
consolidates into one Hugging Face file), and one saved under plain data parallelism loads
into the stages, as does its Hugging Face export: bit for bit, model and AdamW state.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from shardwrap.ckpt.consolidate import consolidate
from tests.dist import pipeline_cases as pc
from tests.dist.harness import run_ranks

EXACT = {"rtol": 0.0, "atol": 0.0}
PP = 2


def _union(states: list[dict], part: str) -> dict:
    merged: dict = {}
    for state in states:
        merged.update(state[part])
    return merged


def _assert_same(got: dict, expected: dict, where: str) -> None:
    assert set(got) == set(expected), (where, sorted(got), sorted(expected))
    for name, value in expected.items():
        if isinstance(value, dict):
            _assert_same(got[name], value, f"{where}/{name}")
        else:
            torch.testing.assert_close(got[name], value, **EXACT, msg=f"{where}/{name}")


def test_pipeline_checkpoint_loads_at_plain_dp(tmp_path):
    path = str(tmp_path / "pp")
    saved = run_ranks(pc.pp_save_worker, 4, PP, "FULL_SHARD", path)
    loaded = run_ranks(pc.dp_load_worker, 3, "SHARD_OPTIM", path)
    for part in ("model", "optim"):
        whole = _union(saved, part)
        for rank, state in enumerate(loaded):
            _assert_same(state[part], whole, f"rank {rank} {part}")
    assert all(state["extra"] == {"step": pc.CKPT_STEPS} for state in loaded)
    # Consolidated for from_pretrained: one file with the whole model.
    out = str(tmp_path / "hf")
    consolidate(path, out)
    exported = load_file(os.path.join(out, "model.safetensors"))
    _assert_same(exported, _union(saved, "model"), "consolidated")


def test_plain_checkpoint_loads_into_stages(tmp_path):
    path = str(tmp_path / "dp")
    saved = run_ranks(pc.dp_save_worker, 2, "FULL_SHARD", path)
    loaded = run_ranks(pc.pp_load_worker, 4, PP, "SHARD_GRAD_OP", path)
    for part in ("model", "optim"):
        whole = saved[0][part]
        stages = [loaded[0], loaded[2]]  # one rank of each stage
        assert set(_union(stages, part)) == set(whole)
        for rank, state in enumerate(loaded):
            mine = {name: whole[name] for name in state[part]}
            assert mine, rank
            _assert_same(state[part], mine, f"rank {rank} {part}")
    # And its Hugging Face export loads into the stages (load_pretrained), exactly.
    out = str(tmp_path / "hf")
    consolidate(path, out)
    for rank, state in enumerate(run_ranks(pc.pp_pretrained_worker, 4, PP, out)):
        _assert_same(state, {n: saved[0]["model"][n] for n in state}, f"rank {rank} pretrained")
