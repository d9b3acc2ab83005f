"""shardwrap.profile on real ranks: its byte counts against what the layouts imply.

One spawned run per world size checks all four strategies (2 ranks; 3 forces padding).
The expected numbers are derived from each unit's ``FlatLayout`` alone:

* FULL_SHARD all-gathers every unit's padded flat parameter twice (forward, then again in
  backward; the ledger counts each collective's full buffer), except once for the unit
  that ran last in forward, which stays gathered into backward; it reduce-scatters each
  padded flat gradient once. SHARD_GRAD_OP and SHARD_OPTIM gather once; NO_SHARD only
  all-reduces the trainable parameters' gradients, all units in one bucket.
* Model state per rank is 4 bytes per shard element (padding included) for parameters,
  4 per owned trainable element for gradients and 8 for AdamW's two moments, plus one
  float32 ``step`` per parameter: 16 * P / N plus padding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardwrap import profile
from shardwrap.assemble.root import root_of
from shardwrap.runtime.step import NUM_DIGEST_WORDS
from tests.dist import parity
from tests.dist.harness import MULTI_RANK_WORLD_SIZES, STRATEGIES, run_ranks

FP32_BYTES = 4
INT32_BYTES = 4  # the presence vote sends one int32 flag per parameter
ADAM_STEP_BYTES = 4  # torch AdamW (not capturable) keeps ``step`` as a float32 scalar
GATHERS_PER_STEP = {"FULL_SHARD": 2, "SHARD_GRAD_OP": 1, "SHARD_OPTIM": 1, "NO_SHARD": 0}


def _handles(model):
    return [(u.name or profile.ROOT_LABEL, u.handle) for u in model.units if u.handle is not None]


def _trainable_piece_numels(handle, rank: int) -> list[int]:
    pieces = handle.layout.pieces(rank if handle.num_shards > 1 else 0)
    return [
        (info.numel if handle.num_shards == 1 else piece.numel)
        for info, piece in zip(handle.layout.params, pieces, strict=True)
        if info.requires_grad
    ]


def _check_collectives(strategy: str, model, step: profile.StepProfile) -> None:
    handles = _handles(model)
    # [Note: the last unit of forward stays gathered]: backward does not gather it again
    last = root_of(model).runtime.schedule.previous_forward_order[-1].handle
    for label, handle in handles:
        padded_bytes = FP32_BYTES * handle.layout.padded_numel
        gathered = step.bytes("all_gather", "params", unit=label)
        gathers = GATHERS_PER_STEP[strategy] - (strategy == "FULL_SHARD" and handle is last)
        assert gathered == gathers * padded_bytes, (label, gathered)
        if strategy != "NO_SHARD":
            assert step.bytes("reduce_scatter", "grads", unit=label) == padded_bytes, label
            assert step.count("reduce_scatter", "grads", unit=label) == 1
    if strategy == "NO_SHARD":
        # [Note: default reduce buckets]: the units fit one bucket, recorded once under a
        # label that names its first and last units. It holds the trainable parameters
        # alone ([Note: packed gradients]: not the root's frozen ``pos``).
        trainable = sum(n for _, h in handles for n in _trainable_piece_numels(h, 0))
        assert step.bytes("all_reduce", "grads") == FP32_BYTES * trainable
        assert step.count("all_reduce", "grads") == 1
        labels = {s.unit for s in step.collectives if s.purpose == "grads"}
        # backward order: the last block first, the root (reduced at the end) last
        first, last = handles[-1][0], profile.ROOT_LABEL
        assert labels == {f"{first}..{last} ({len(handles)} units)"}, labels
    num_params = sum(len(h.layout.params) for _, h in handles)
    vote = step.bytes("all_reduce", "grad_presence", unit=profile.SHARED_LABEL)
    assert vote == INT32_BYTES * (num_params + NUM_DIGEST_WORDS)  # [Note: rank agreement]
    assert all(s.seconds > 0.0 for s in step.collectives), "a collective was not timed"


def _expected_memory(strategy: str, model, rank: int) -> dict[str, int]:
    handles = [h for _, h in _handles(model)]
    trainable = [n for h in handles for n in _trainable_piece_numels(h, rank)]
    keeps_full = strategy == "SHARD_OPTIM"  # ZeRO-1 keeps the gathered copy between steps
    return {
        "full_params": sum(FP32_BYTES * h.layout.padded_numel for h in handles)
        if keeps_full
        else 0,
        "param_shards": sum(FP32_BYTES * h.layout.shard_numel for h in handles),
        # NO_SHARD: views of the default bucket's kept buffer, which holds the trainable
        # parameters alone ([Note: packed gradients])
        "grads": FP32_BYTES * sum(trainable),
        "optimizer_state": sum(2 * FP32_BYTES * n + ADAM_STEP_BYTES for n in trainable),
    }


def _one_strategy(rank: int, world_size: int, strategy: str) -> dict[str, int]:
    case = parity.Case(strategy=strategy)
    model = parity.build_model("gpt")
    reference = copy.deepcopy(model)
    sharded = parity.wrap_case(model, case)
    optim = torch.optim.AdamW(sharded.parameters(), lr=0.01)
    assert all(r.elapsed_s is None for r in sharded.comm_ledger.records)
    for step_index in range(2):
        optim.zero_grad()
        with profile.profile_step(sharded) as step:
            loss = parity.loss_for("gpt", sharded, parity.batch_for("gpt", rank), step_index)
            loss.backward()
            optim.step()
    # Step 1 uses the optional branch, so every trainable parameter has a gradient now.
    _check_collectives(strategy, sharded, step)
    memory = profile.memory_by_category(sharded, optim)
    assert memory == _expected_memory(strategy, sharded, rank), memory
    trainable = sum(p.numel() for p in reference.parameters() if p.requires_grad)
    return {"memory": memory, "trainable": trainable, "num_steps": len(optim.state)}


def _all_strategies(rank: int, world_size: int) -> dict[str, dict]:
    return {s: _one_strategy(rank, world_size, s) for s in STRATEGIES}


@pytest.mark.parametrize("world_size", MULTI_RANK_WORLD_SIZES)
def test_profile_bytes_match_layout_theory(world_size: int) -> None:
    per_rank = run_ranks(_all_strategies, world_size)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        results = [r[strategy] for r in per_rank]
        trainable = results[0]["trainable"]
        # Summed over ranks, gradients and moments cover each trainable element exactly once.
        grads = sum(r["memory"]["grads"] for r in results)
        moments = sum(r["memory"]["optimizer_state"] for r in results)
        steps = sum(ADAM_STEP_BYTES * r["num_steps"] for r in results)
        assert grads == FP32_BYTES * trainable
        assert moments - steps == 2 * FP32_BYTES * trainable
    no_shard = [r["NO_SHARD"]["memory"] for r in per_rank]
    assert all(m == no_shard[0] for m in no_shard), "NO_SHARD ranks hold different state"
