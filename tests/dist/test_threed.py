"""3-D parallelism: TP2 x PP2 x DP2 on 8 gloo ranks, one checkpoint for every layout.

Each pipeline stage is split by torch's ``parallelize_module`` over ``mesh["tp"]``,
wrapped in ``ShardedModule`` over ``mesh["dp"]`` (ZeRO-3, ZeRO-2, ZeRO-1) and driven by
torch's ``Schedule1F1B`` / ``ScheduleGPipe`` through ``ShardedPipelineStage``; see
tests/dist/threed_cases.py. Losses and full parameters after 3 AdamW steps are compared
with single-process training on the global batch within bounds on float32 rounding (TP
splits the matmuls' sums, so the bits may differ, not the values; see [Note: tolerances
from bounds] in tests/tolerances.py). Checkpoints: the
3-D one loads at plain DP 3 and, consolidated, into the unwrapped model; one saved at
plain DP loads into the 3-D layout; each exactly, model and optimizer state. A tiny
Hugging Face Llama in two stages (tests/dist/threed_hf_cases.py) trains as the plain model
does, and ``python -m shardwrap consolidate`` turns its checkpoint into a folder that
``AutoModelForCausalLM.from_pretrained`` loads exactly.

8 ranks used to be slow to start (8 interpreters importing torch, shardwrap and
transformers); they are forked from the harness's preloaded server now ([Note: pooled
ranks are forked]): the module took 88 CPU seconds before, 34 after
(benchmarks/RESULTS.md, "Test suite cost"). The training (with the save) still runs once,
in a module fixture, the loads in one test, and the 8-rank pool, used by no other module,
ends with this one (the Llama test reuses it).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import shardwrap.__main__ as cli
from shardwrap.ckpt.consolidate import consolidate
from shardwrap.ckpt.format import SHARD_FILE_PATTERN
from tests.dist import threed_cases as tc
from tests.dist import threed_hf_cases as hc
from tests.dist.harness import release_pool, run_ranks
from tests.tolerances import check_losses, reordered_loss_atols, reordered_param_tol

WORLD = tc.PP * tc.DP * tc.TP
EXACT = {"rtol": 0.0, "atol": 0.0}


def _union(states: list[dict], part: str) -> dict:
    merged: dict = {}
    for state in states:
        merged.update(state[part])
    return merged


def _assert_same(got: dict, expected: dict, where: str, **tolerance) -> None:
    assert set(got) == set(expected), (where, sorted(got), sorted(expected))
    for name, value in expected.items():
        if isinstance(value, dict):
            _assert_same(got[name], value, f"{where}/{name}", **tolerance)
        else:
            torch.testing.assert_close(got[name], value, msg=f"{where}/{name}", **tolerance)


def _loss_atols(losses: list[float], params: dict, grad_l1s: list[float]) -> list[float]:
    """Each step's loss: its own rounding and the drift of the steps before it."""
    largest = max(float(p.abs().max()) for p in params.values())
    return reordered_loss_atols(losses, grad_l1s, largest, reordered_param_tol)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("threed") / "ckpt")
    yield path, run_ranks(tc.train_worker, WORLD, path)
    release_pool(WORLD)


def test_threed_training_matches_single_process(trained):
    ref_losses, ref_params, grad_l1s = tc.reference_run()
    loss_atols = _loss_atols(ref_losses, ref_params, grad_l1s)
    _, results = trained
    for case in tc.CASES:
        stages = [by_case[case] for by_case in results]
        for rank, out in enumerate(stages):
            where = f"rank {rank} {case}"
            if rank // (tc.DP * tc.TP) == tc.PP - 1:  # the last stage computes the losses
                check_losses(out["losses"], ref_losses, loss_atols, where)
            mine = {name: ref_params[name] for name in out["model"]}
            _assert_same(out["model"], mine, where, **reordered_param_tol(tc.NUM_STEPS))
            # Gradients are reduced over the data-parallel group only, once per unit and
            # step (after the last microbatch's backward).
            for step in out["reductions"]:
                assert step == {"count": out["units"], "group_sizes": [tc.DP]}, (where, step)
        # The two stages together hold the whole model.
        assert set(stages[0]["model"]) | set(stages[-1]["model"]) == set(ref_params)
    # Measured: fp32 AdamW at ZeRO-3 holds 16 bytes per element of the rank's share (its
    # stage's TP-split parameters / TP, replicated ones whole) / DP, plus padding.
    for rank, by_case in enumerate(results):
        out = by_case[("FULL_SHARD", "1f1b", False)]
        local, units = tc.local_numel(out["pp_rank"]), out["units"]
        assert 16 * local // tc.DP <= out["model_state_bytes"], rank
        assert out["model_state_bytes"] <= 16 * (local + units * (tc.DP - 1)) // tc.DP, rank


def test_threed_checkpoint_loads_in_every_layout(trained, tmp_path):
    path, results = trained
    saved = [by_case[tc.SAVED_CASE] for by_case in results]
    whole = {part: _union(saved, part) for part in ("model", "optim")}
    # At plain DP 3 (ZeRO-1), exactly, model and optimizer; and it saves a DP checkpoint.
    dp_path = str(tmp_path / "dp3")
    at_dp = run_ranks(tc.dp_load_then_save, 3, path, dp_path)
    for rank, out in enumerate(at_dp):
        for part in ("model", "optim"):
            _assert_same(out["loaded"][part], whole[part], f"dp rank {rank} {part}", **EXACT)
        assert out["loaded"]["extra"] == {"step": tc.NUM_STEPS}
    # Consolidated into one Hugging Face file: the unwrapped model loads it exactly.
    consolidate(path, str(tmp_path / "hf"))
    model = tc.whole_model(seed=99)
    model.load_state_dict(load_file(os.path.join(tmp_path / "hf", "model.safetensors")))
    _assert_same(model.state_dict(), whole["model"], "unwrapped", **EXACT)
    # The reverse: the plain DP checkpoint loads into fresh 3-D stages (ZeRO-3) exactly.
    dp_saved = at_dp[0]["saved"]
    for rank, out in enumerate(run_ranks(tc.load_worker, WORLD, "FULL_SHARD", dp_path)):
        assert out["extra"] == {"step": tc.NUM_STEPS + tc.CKPT_STEPS}
        for part in ("model", "optim"):
            mine = {name: dp_saved[part][name] for name in out[part]}
            assert mine, (rank, part)
            _assert_same(out[part], mine, f"3-D rank {rank} {part}", **EXACT)


def test_tp_replicas_without_tp_parameters_save_each_range_once(tmp_path):
    """A model with no tensor-parallel parameter wrapped over ``mesh["dp"]`` of a
    (dp, tp) mesh (an unparallelized stage in a TP job): its TP ranks hold the same
    shards, nothing in the model says so, and the checkpoint still takes each range once
    ([Note: replicas the model cannot see]); it loads at plain DP 3 exactly."""
    path = str(tmp_path / "replicas")
    saved = run_ranks(tc.tp_replicas_save, 4, path)
    for rank, out in enumerate(saved):
        _assert_same(out, saved[0], f"rank {rank} as saved", **EXACT)  # replicas agree
    # One shard file per data-parallel rank: the TP replicas' copies were removed.
    shard_files = [n for n in os.listdir(path) if SHARD_FILE_PATTERN.match(n)]
    assert len(shard_files) == 2, sorted(os.listdir(path))
    for rank, out in enumerate(run_ranks(tc.dp_load, 3, path)):
        assert out.pop("extra") == {"step": tc.CKPT_STEPS}
        _assert_same(out, saved[0], f"dp rank {rank}", **EXACT)


def test_threed_hugging_face_llama_consolidates_for_from_pretrained(tmp_path):
    """A tiny Llama, TP2 x PP2 x DP2 at ZeRO-3 (threed_hf_cases.py): trains as the plain
    model in one process does; ``python -m shardwrap consolidate`` turns its checkpoint
    into a folder that ``AutoModelForCausalLM.from_pretrained`` loads exactly."""
    import transformers

    path, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    shape = {"pp": tc.PP, "dp": tc.DP, "tp": tc.TP}
    results = run_ranks(hc.train_worker, WORLD, shape, path)
    ref_losses, ref_params, grad_l1s = hc.reference_run(tc.DP)
    loss_atols = _loss_atols(ref_losses, ref_params, grad_l1s)
    for rank, result in enumerate(results):
        if result["is_last"]:
            check_losses(result["losses"], ref_losses, loss_atols, f"rank {rank}")
        mine = {name: ref_params[name] for name in result["model"]}
        _assert_same(result["model"], mine, f"rank {rank}", **reordered_param_tol(hc.NUM_STEPS))
        # fp32 AdamW at ZeRO-3: 16 bytes per element of the rank's TP share / DP (+ padding).
        local, units = hc.local_numel(result["pp_rank"], tc.TP), result["units"]
        assert 16 * local // tc.DP <= result["model_state_bytes"], rank
        assert result["model_state_bytes"] <= 16 * (local + units * (tc.DP - 1)) // tc.DP, rank
    trained = _union(results, "model")
    assert set(trained) == set(ref_params)
    assert cli.main(["consolidate", path, out, "--quiet"]) == 0
    hc.config().save_pretrained(out)  # the config travels beside the weights, as documented
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    _assert_same(dict(loaded.state_dict()), trained, "from_pretrained", **EXACT)
