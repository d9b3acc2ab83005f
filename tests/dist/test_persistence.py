"""``param_persistence_threshold``: small units stay whole, results stay those of one process.

TinyGPT's root unit holds 3,680 elements and each block 12,608; the MLP's linear units
hold 390, 930, 930 and 31. The thresholds below make the root alone, every unit, or the
MLP's outer layers persistent, so sharded and persistent units train side by side.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import shardwrap
from shardwrap.base.warn_once import forget_warned
from shardwrap.comm.collectives import ROOT_LABEL
from shardwrap.deepspeed.config import DeepSpeedConfig
from shardwrap.planner.estimate import estimate_memory
from tests.dist import engine_cases
from tests.dist.ckpt_workers import STEPS_PER_PHASE, assemble, phase
from tests.dist.harness import run_ranks
from tests.dist.parity import (
    Case,
    batch_for,
    build_model,
    check_shards,
    clipped_grad_multiple,
    concat,
    loss_for,
    make_optimizer,
    norm_tol,
    optimizer_state_tol,
    reordered_tol,
    train_and_compare,
    trainable_numel,
    wrap_case,
)
from tests.dist.test_planner import _check as check_planner_rows
from tests.dist.test_planner import _planner_worker

ROOT_ONLY = 5_000  # TinyGPT: the root unit (3,680) is persistent, the blocks (12,608) not
EVERY_UNIT = 20_000  # TinyGPT: every unit is persistent
MLP_OUTER = 500  # MLP: the first (390) and last (31) linear units are persistent
BLOCK_NAMES = ("blocks.0", "blocks.1")
MAX_NORM = 0.3  # small enough that every step clips

CASES = [
    Case(param_persistence_threshold=ROOT_ONLY),
    Case(param_persistence_threshold=EVERY_UNIT),
    Case(model="mlp", param_persistence_threshold=MLP_OUTER, forward_prefetch=True),
    Case(model="mlp", param_persistence_threshold=MLP_OUTER, reduce_bucket_bytes=1 << 30),
]
# Two ranks in one shard group, one replica: persistent units reduce over the world.
HYBRID = Case(strategy="HYBRID_SHARD", hybrid_shard_size=2, param_persistence_threshold=ROOT_ONLY)


def _parity_worker(rank: int, world_size: int, strategies: list[str]) -> int:
    for strategy in strategies:
        for case in CASES:
            train_and_compare(rank, world_size, Case(**{**case.__dict__, "strategy": strategy}))
    train_and_compare(rank, world_size, HYBRID)
    return len(strategies) * len(CASES) + 1


def test_persistent_units_match_reference() -> None:
    # Three ranks (uneven padding) train against the reference in the checkpoint test.
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM"]
    expected = len(strategies) * len(CASES) + 1
    assert run_ranks(_parity_worker, 2, strategies) == [expected] * 2


def _traffic_worker(rank: int, world_size: int, runs: list[tuple[str, int]]) -> list[dict]:
    return [
        _one_step_traffic(rank, world_size, strategy, threshold) for strategy, threshold in runs
    ]


def _one_step_traffic(rank: int, world_size: int, strategy: str, threshold: int) -> dict:
    """One clipped step next to the reference; the step's collectives by unit."""
    model = build_model("gpt")
    reference = copy.deepcopy(model)
    sharded = wrap_case(model, Case(strategy=strategy, param_persistence_threshold=threshold))
    # SGD: a first AdamW step turns float noise in near-zero gradients into whole steps
    optim, ref_optim = make_optimizer(sharded, "sgd"), make_optimizer(reference, "sgd")
    batches = [batch_for("gpt", r) for r in range(world_size)]
    loss_for("gpt", reference, concat(batches), step=1).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    sharded.comm_ledger.reset()
    loss_for("gpt", sharded, batches[rank], step=1).backward()
    norm = sharded.clip_grad_norm_(MAX_NORM)  # replicated units' norm counted once
    records = list(sharded.comm_ledger.records)  # after ZeRO-1's reduction at the clip
    torch.testing.assert_close(norm, ref_norm, **norm_tol(2.0, reference, ref_norm))
    optim.step()
    ref_optim.step()
    # every step clips: the clipped gradients (the momentum after one step), and one SGD step
    multiple = clipped_grad_multiple(trainable_numel(reference), MAX_NORM)
    tol = reordered_tol("sgd", 1, grad_multiple=multiple)
    momentum_tol = optimizer_state_tol("momentum_buffer", 2)
    momentum_tol = {**momentum_tol, "atol": multiple * momentum_tol["atol"]}
    check_shards(sharded, reference, exact=False, tol=tol)
    reference_params = dict(reference.named_parameters())
    with sharded.summon_full_params(sharded, writeback=False):
        for name, param in sharded.named_parameters():
            torch.testing.assert_close(param, reference_params[name], **tol)
    full = sharded.state_dict()
    for name, value in reference.state_dict().items():
        where = f"state_dict {name}"
        torch.testing.assert_close(full[name], value, msg=lambda m, w=where: f"{w}: {m}", **tol)
    optim_state = shardwrap.ShardedModule.optim_state_dict(sharded, optim)["state"]
    for name, param in reference_params.items():
        if param in ref_optim.state:
            momentum = optim_state[name]["momentum_buffer"]
            reference_momentum = ref_optim.state[param]["momentum_buffer"]
            torch.testing.assert_close(momentum, reference_momentum, **momentum_tol)
    return {
        "gathers": Counter(r.unit for r in records if r.kind == "all_gather"),
        "gather_bytes": _bytes_by_unit(r for r in records if r.kind == "all_gather"),
        "grads": Counter((r.unit, r.kind) for r in records if r.purpose == "grads"),
        "persistent": {u.name or ROOT_LABEL: u.handle.num_shards == 1 for u in sharded.units},
        "root_numel": sharded.units[0].handle.layout.padded_numel,
    }


def _bytes_by_unit(records) -> dict[str, int]:
    totals: Counter[str] = Counter()
    for record in records:
        totals[record.unit] += record.num_bytes
    return dict(totals)


def test_persistent_root_is_never_gathered_and_all_reduced() -> None:
    off, on = run_ranks(_traffic_worker, 2, [("FULL_SHARD", 0), ("FULL_SHARD", ROOT_ONLY)])[0]
    assert on["persistent"] == {ROOT_LABEL: True, **dict.fromkeys(BLOCK_NAMES, False)}
    assert not any(off["persistent"].values())
    # without the threshold the root is gathered for forward and again for backward
    assert off["gathers"][ROOT_LABEL] == 2 and on["gathers"][ROOT_LABEL] == 0
    for block in BLOCK_NAMES:  # the sharded units are untouched
        assert on["gathers"][block] == off["gathers"][block] == 2
        assert on["grads"][(block, "reduce_scatter")] == 1
    assert off["grads"][(ROOT_LABEL, "reduce_scatter")] == 1
    assert on["grads"][(ROOT_LABEL, "all_reduce")] == 1
    assert (ROOT_LABEL, "reduce_scatter") not in on["grads"]
    saved = off["gather_bytes"][ROOT_LABEL]
    assert saved == 2 * on["root_numel"] * 4  # two fp32 gathers of the whole root
    assert sum(on["gather_bytes"].values()) == sum(off["gather_bytes"].values()) - saved


def test_every_unit_persistent_moves_no_parameters() -> None:
    runs = [("SHARD_GRAD_OP", EVERY_UNIT), ("SHARD_OPTIM", EVERY_UNIT)]
    for result in run_ranks(_traffic_worker, 2, runs)[0]:
        assert all(result["persistent"].values())
        assert sum(result["gathers"].values()) == 0
        assert {kind for _, kind in result["grads"]} == {"all_reduce"}


def test_checkpoint_resumes_across_thresholds_and_world_sizes(tmp_path) -> None:
    """Save with the root persistent on 2 ranks; load with every unit persistent on 3."""
    chain = [(2, "FULL_SHARD", ROOT_ONLY), (3, "SHARD_GRAD_OP", EVERY_UNIT)]
    snapshot = previous = None
    for number, (world_size, strategy, threshold) in enumerate(chain):
        target = str(tmp_path / f"ckpt{number}")
        first_step = number * STEPS_PER_PHASE
        pieces = run_ranks(
            phase, world_size, strategy, previous, target, snapshot, first_step, threshold
        )
        snapshot = assemble(pieces)
        previous = target


def _planner_rows_worker(rank: int, world_size: int) -> list[tuple]:
    gpt_cases = [("gpt", None), ("gpt", torch.bfloat16)]
    return _planner_worker(rank, world_size, gpt_cases, ROOT_ONLY) + _planner_worker(
        rank, world_size, [("mlp", None)], MLP_OUTER
    )


def test_planner_matches_bytes_held_with_persistent_units() -> None:
    """Every stage, fp32 and bf16 compute, persistent units: within the planner's 5%."""
    for rank_rows in run_ranks(_planner_rows_worker, 2):
        check_planner_rows(rank_rows)


def test_planner_counts_a_persistent_unit_whole() -> None:
    num_params = 10_000
    sharded = estimate_memory(num_params, world_size=4, stage=3)
    whole = estimate_memory(num_params, world_size=4, stage=3, param_persistence_threshold=10**6)
    assert sharded.bytes("parameters") == num_params * 4 // 4
    assert whole.bytes("parameters") == num_params * 4
    assert whole.bytes("optimizer_state") == 2 * num_params * 4
    assert whole.bytes("gathered_parameters") == 0 < sharded.bytes("gathered_parameters")


def _engine_worker(rank: int, world_size: int) -> list[bool]:
    """Stage 3 through ``initialize`` with the DeepSpeed key, against the reference."""
    model = build_model("gpt")
    reference = engine_cases.Reference(copy.deepcopy(model), clipping=0.5)
    config = engine_cases.ds_config(stage=3, accumulation=2, clipping=0.5)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = ROOT_ONLY
    engine, _, _, _ = shardwrap.initialize(
        model=model, config=config, auto_wrap_policy=engine_cases.wrap_policy("gpt")
    )
    for step in range(2):
        reference.step(step, world_size, accumulation=2)
        engine_cases.engine_step(engine, rank, step, world_size, accumulation=2)
        engine_cases.check_engine(engine, reference, step + 1, world_size)
    return [u.handle.num_shards == 1 for u in engine.module.units]


def test_engine_maps_the_deepspeed_threshold() -> None:
    assert run_ranks(_engine_worker, 2) == [[True, False, False]] * 2


def _zero(**zero) -> object:
    return DeepSpeedConfig.load(
        {"train_batch_size": 8, "zero_optimization": zero}
    ).zero_optimization


def test_deepspeed_threshold_applies_only_when_given_at_stage_3() -> None:
    assert (
        _zero(stage=3, stage3_param_persistence_threshold=1e4).unit_persistence_threshold == 10**4
    )
    # DeepSpeed's default is per parameter: not applied to whole units
    default = _zero(stage=3)
    assert default.unit_persistence_threshold == 0
    # stages 1-2 never partition parameters in DeepSpeed: the stage-3 key does nothing
    forget_warned()  # an earlier test in this process may have warned already
    with pytest.warns(UserWarning, match="stage3_param_persistence_threshold.*stage 3 only"):
        stage_2 = _zero(stage=2, stage3_param_persistence_threshold=10)
    assert stage_2.unit_persistence_threshold == 0
    with pytest.raises(ValueError, match="unknown key 'unit_persistence_threshold'"):
        _zero(stage=3, unit_persistence_threshold=10)


def _bad_threshold(value) -> None:
    shardwrap.ShardedModule(build_model("mlp"), param_persistence_threshold=value)


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("1e5", TypeError)]
)
def test_threshold_is_validated(one_rank, value, error) -> None:
    with pytest.raises(error, match="param_persistence_threshold"):
        _bad_threshold(value)


@pytest.mark.parametrize("threshold", [ROOT_ONLY, EVERY_UNIT])
def test_one_rank_is_bit_exact(one_rank, threshold: int) -> None:
    train_and_compare(0, 1, Case(param_persistence_threshold=threshold))
