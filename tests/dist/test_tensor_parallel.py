"""ZeRO inside tensor parallelism: a (dp=2, tp=2) mesh of 4 gloo ranks, the model split by
torch's ``parallelize_module`` and wrapped over ``mesh["dp"]``; see tests/dist/tp_cases.py.

Every result is compared with single-process training of the unparallelized model on the
global batch within bounds on float32 rounding: TP splits the matmuls' sums, so the bits
may differ, not the values (tests/tolerances.py, [Note: tolerances from bounds]).
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from shardwrap.ckpt.consolidate import consolidate
from tests.dist import tp_bf16_cases, tp_cases
from tests.dist.harness import run_ranks
from tests.tolerances import (
    GRAD_SCALE,
    REORDERED_VALUE_TOL,
    check_losses,
    clipped_grad_multiple,
    reordered_loss_atols,
    reordered_param_atol,
    reordered_param_tol,
    step_rounding_rtol,
)

WORLD = tp_cases.DP * tp_cases.TP
EXACT = {"rtol": 0.0, "atol": 0.0}
# fp32 against the single-process reference, from the bounds in tests/tolerances.py: norms
# (VALUES: their own rounding; those after the first step also carry the parameters' drift
# through the loss's curvature, which the tolerances do not bound); parameters after 2
# steps of tp_cases' AdamW (REORDER_SAFE_ADAMW), and after 5 clipped ones
# (clipped_param_tol); losses within reordered_loss_atols of the drift before them.
VALUES = REORDERED_VALUE_TOL
MAX_NORM = 0.5
PARAMS_2 = reordered_param_tol(2)


def clipped_param_tol(num_steps: int) -> dict[str, float]:
    """Parameters after ``num_steps`` AdamW steps on gradients clipped to ``MAX_NORM``."""
    numel = sum(p.numel() for p in tp_cases.build_reference().parameters())
    scale = GRAD_SCALE * clipped_grad_multiple(numel, MAX_NORM)
    atol = reordered_param_atol(num_steps, grad_scale=scale)
    return {"rtol": step_rounding_rtol(num_steps), "atol": atol}


PARAMS_5 = clipped_param_tol(tp_cases.NUM_STEPS)


def _loss_atols(reference) -> list[float]:
    losses, _, state, grad_l1s = reference
    largest = max(float(v.abs().max()) for v in state.values())
    return reordered_loss_atols([float(v) for v in losses], grad_l1s, largest, clipped_param_tol)


# bf16 training against an fp32 reference: bf16 keeps 8 bits of mantissa, so one rounding
# moves a value by at most BF16_EPS / 2 of itself. A gradient of this 2-block model passes
# through at most 32 bf16 roundings between the loss and the fp32 reduction (the weights'
# cast, then each op's output in forward and in backward), so to first order each SGD
# update is within 32 * BF16_EPS / 2 of fp32's, relative, as a 2-norm per parameter.
# (Measured: 0.016. Zeroed gradients give 1.0, halved ones 0.5.)
BF16_EPS = 2.0**-8
BF16_UPDATE_RTOL = 16 * BF16_EPS


def _assert_states(got: dict, expected: dict, **tolerance) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name, **tolerance)


@pytest.fixture(scope="module")
def reference():
    return tp_cases.reference_run(max_norm=MAX_NORM)


def test_training_matches_reference(reference):
    """ZeRO-3, ZeRO-2, ZeRO-1 and plain data parallelism (NO_SHARD: in-place all-reduce,
    reduce buckets) with clipping: losses, norms and full parameters."""
    ref_losses, ref_norms, ref_params, _ = reference
    loss_atols = _loss_atols(reference)
    strategies = ("FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM", "NO_SHARD")
    results = run_ranks(tp_cases.train_strategies, WORLD, strategies, MAX_NORM)
    for rank, by_strategy in enumerate(results):
        for strategy, out in by_strategy.items():
            where = f"rank {rank}, {strategy}"
            check_losses(out["losses"], ref_losses, loss_atols, where)
            torch.testing.assert_close(torch.stack(out["norms"]), torch.stack(ref_norms), **VALUES)
            _assert_states(out["state"], ref_params, **PARAMS_5)
            # Units computed with DTensors of the global shape; gradients went over DP only.
            assert out["shown"] == {"DTensor": (tp_cases.DIM, tp_cases.DIM)}, where
            assert out["grad_group_sizes"] == {tp_cases.DP}, where
            assert out["tp_grad_records"] == 0, where  # gradients came in their placements
        # Measured: fp32 AdamW at ZeRO-3 holds 16 bytes per element of this TP rank's
        # share (TP-split parameters / TP, replicated ones whole) / DP, plus padding.
        out = by_strategy["FULL_SHARD"]
        local, dp, units = tp_cases.local_numel(), tp_cases.DP, out["num_units"]
        assert local < sum(p.numel() for p in ref_params.values())
        assert 16 * local // dp <= out["model_state_bytes"]
        assert out["model_state_bytes"] <= 16 * (local + units * (dp - 1)) // dp


def test_sequence_parallel_matches_reference(reference):
    """Norm weights get Partial gradients (summed over TP before the DP reduction); the
    embedding and head are vocab-parallel DTensors too."""
    ref_losses, ref_norms, ref_params, _ = reference
    loss_atols = _loss_atols(reference)
    for out in run_ranks(tp_cases.train_tp, WORLD, "FULL_SHARD", MAX_NORM, 5, True):
        check_losses(out["losses"], ref_losses, loss_atols, "sequence parallel")
        torch.testing.assert_close(torch.stack(out["norms"]), torch.stack(ref_norms), **VALUES)
        _assert_states(out["state"], ref_params, **PARAMS_5)
        assert out["tp_grad_records"] > 0  # Partial gradients were summed over TP
        assert out["grad_group_sizes"] == {tp_cases.DP}


def test_no_sync_and_summon_full_params():
    expected = tp_cases.reference_no_sync()
    for out in run_ranks(tp_cases.summon_and_no_sync, WORLD):
        _assert_states(out["state"], expected, **PARAMS_2)
        for name, (_kind, shape, value) in out["summoned"].items():
            assert shape == tuple(expected[name].shape), name
            torch.testing.assert_close(value, expected[name], msg=name, **PARAMS_2)
        assert out["summoned"]["blocks.0.fc.weight"][0] == "DTensor"
        assert out["summoned"]["tok.weight"][0] == "Parameter"


def test_hybrid_shard_on_a_slice_of_a_3d_mesh():
    expected = tp_cases.reference_run(num_steps=2)[2]
    for state in run_ranks(tp_cases.hybrid_state, WORLD, 2):
        _assert_states(state, expected, **PARAMS_2)


def test_cpu_offload_and_activation_checkpointing():
    expected = tp_cases.reference_run(num_steps=2)[2]
    for states in run_ranks(tp_cases.offload_and_checkpointing, WORLD, 2):
        for case, state in states.items():
            assert set(state) == set(expected), case
            _assert_states(state, expected, **PARAMS_2)


def test_what_tp_refuses_is_named():
    for messages in run_ranks(tp_cases.refusals, WORLD):
        assert "sync_module_states" in messages["sync_module_states"]
        assert "DTensor" in messages["sync_module_states"]
        assert "SHARDED_STATE_DICT" in messages["sharded_state_dict"]
        assert "blocks.0.q.weight" in messages["sharded_state_dict"]


def test_mixed_precision_follows_reference():
    """bf16 parameters, fp32 reduction, SGD: every parameter's update on every rank within
    BF16_UPDATE_RTOL of single-process fp32 training's; zeroed gradients (the
    negative control) must not be."""
    initial, expected = tp_bf16_cases.reference()
    for rank, runs in enumerate(run_ranks(tp_bf16_cases.bf16_run, WORLD, tp_bf16_cases.FAULTS)):
        for fault, state in runs.items():
            assert set(state) == set(expected)
            errors = tp_bf16_cases.update_errors(initial, expected, state)
            worst = max(errors, key=errors.get)
            if fault is None:
                assert errors[worst] <= BF16_UPDATE_RTOL, (rank, worst, errors[worst])
            else:
                assert errors[worst] > BF16_UPDATE_RTOL, (rank, fault, "went unnoticed")


def _assert_same_states(got: dict, saved: dict) -> None:
    _assert_states(got["model"], saved["model"], **EXACT)
    assert got["optim"]["param_groups"] == saved["optim"]["param_groups"]
    assert set(got["optim"]["state"]) == set(saved["optim"]["state"])
    for name, states in saved["optim"]["state"].items():
        _assert_states(got["optim"]["state"][name], states, **EXACT)


def test_checkpoint_from_tp_dp_loads_at_dp_1_2_3_tp4_and_unwrapped(tmp_path):
    path = str(tmp_path / "tp2dp2")
    saved = run_ranks(tp_cases.save_tp, WORLD, path)[0]
    for world_size in (1, 2, 3):  # plain data parallelism, padded unevenly at 3
        for got in run_ranks(tp_cases.load_dp, world_size, path):
            _assert_same_states(got, saved)
    for got in run_ranks(tp_cases.load_tp, WORLD, path, 4):  # another TP degree: TP4 x DP1
        _assert_same_states(got, saved)
    consolidate(path, str(tmp_path / "hf"))
    model = tp_cases.TPNet()
    weights = safetensors.torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    model.load_state_dict(weights)
    _assert_states(model.state_dict(), saved["model"], **EXACT)
    # ... and the Hugging Face folder back into TP2 x DP2.
    for state in run_ranks(tp_cases.pretrained_tp, WORLD, str(tmp_path / "hf")):
        _assert_states(state, saved["model"], **EXACT)


def test_checkpoint_from_dp2_loads_at_tp_dp(tmp_path):
    path = str(tmp_path / "dp2")
    saved = run_ranks(tp_cases.save_dp, 2, path)[0]
    for got in run_ranks(tp_cases.load_tp, WORLD, path):
        _assert_same_states(got, saved)
        _assert_same_states(got["reloaded"], saved)  # full state dicts, loaded under TP
