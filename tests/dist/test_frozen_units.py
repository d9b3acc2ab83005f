"""Units whose parameters are all frozen: trained like the reference, with no reduction.

See [Note: frozen units] in shardwrap/hooks.py. Two shapes of frozen unit: the MLP's first
layer (``body.0``: its input needs no gradient, so backward never reaches it) and the
GPT's first block (``blocks.0``: the trainable embedding below it needs the gradient
that flows through it, so backward gathers it).
"""

from __future__ import annotations

import pytest
import torch

import shardwrap
from shardwrap import profile
from shardwrap.assemble.root import root_of
from tests.dist import parity
from tests.dist.harness import MULTI_RANK_WORLD_SIZES, STRATEGIES, run_ranks

FROZEN = {"mlp": "body.0", "gpt": "blocks.0"}
# Frozen weights beside trainable ones in each block, as adapters are trained.
MIXED = ("blocks.0.qkv", "blocks.0.fc", "blocks.1.qkv", "blocks.1.out")
PARITY_CASES = [
    *(parity.Case(strategy=s, model=m, frozen=(f,)) for s in STRATEGIES for m, f in FROZEN.items()),
    # reduce buckets: a plan must skip the frozen unit; concatenated and per-unit too
    parity.Case(strategy="NO_SHARD", model="gpt", frozen=("blocks.0",), reduce_bucket_bytes=0),
    parity.Case(strategy="FULL_SHARD", model="gpt", frozen=("blocks.0",), reduce_bucket_bytes=4096),
    parity.Case(strategy="FULL_SHARD", model="mlp", frozen=("body.0",), forward_prefetch=True),
    # units mixing frozen and trainable parameters ([Note: packed gradients])
    *(parity.Case(strategy=s, model="gpt", frozen=MIXED) for s in STRATEGIES),
    parity.Case(strategy="FULL_SHARD", model="gpt", frozen=MIXED, reduce_bucket_bytes=1 << 20),
]


def _train_cases(rank: int, world_size: int) -> int:
    for case in PARITY_CASES:
        parity.train_and_compare(rank, world_size, case)
    return len(PARITY_CASES)


def test_frozen_units_train_like_the_reference() -> None:
    assert run_ranks(_train_cases, 2) == [len(PARITY_CASES)] * 2


def _frozen_model(kind: str, strategy: str) -> shardwrap.ShardedModule:
    model = parity.build_model(kind)
    model.get_submodule(FROZEN[kind]).requires_grad_(False)
    return parity.wrap_case(model, parity.Case(strategy=strategy, model=kind))


def _collectives(rank: int, world_size: int, kind: str) -> dict[str, dict]:
    """Per strategy: the frozen unit's gathers and reductions in step 2, and its state when
    backward ended (before the end-of-backward callback)."""
    results = {}
    for strategy in STRATEGIES:
        model = _frozen_model(kind, strategy)
        frozen = next(u for u in model.units if u.name == FROZEN[kind])
        runtime = root_of(model).runtime
        seen = []
        finalize = runtime.finalize_backward

        def recording_finalize(frozen=frozen, finalize=finalize, seen=seen):
            seen.append((frozen.state.name, frozen.handle.full_storage_bytes))
            finalize()

        runtime.finalize_backward = recording_finalize
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        for step in range(2):
            with profile.profile_step(model) as prof:
                parity.loss_for(kind, model, parity.batch_for(kind, rank), step).backward()
                optim.step()
                optim.zero_grad()
        trainable = [
            u.handle
            for u in model.units
            if u.handle and any(i.requires_grad for i in u.handle.layout.params)
        ]
        results[strategy] = {
            "frozen_gathers": prof.count("all_gather", "params", unit=frozen.name),
            "frozen_reductions": sum(
                prof.count(kind_, "grads", unit=frozen.name)
                for kind_ in ("all_reduce", "reduce_scatter")
            ),
            "grad_bytes": sum(
                prof.bytes(kind_, "grads") for kind_ in ("all_reduce", "reduce_scatter")
            ),
            "trainable_padded_bytes": 4 * sum(h.layout.padded_numel for h in trainable),
            "trainable_bytes": 4 * sum(p.numel() for p in model.parameters() if p.requires_grad),
            "all_reduces": prof.count("all_reduce", "grads"),
            "state_at_backward_end": seen[-1],
        }
    return results


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_frozen_units_move_no_gradient_bytes(kind: str) -> None:
    for per_strategy in run_ranks(_collectives, 2, kind):
        for strategy, got in per_strategy.items():
            where = f"{kind} {strategy}: {got}"
            assert got["frozen_reductions"] == 0, where
            if strategy == "NO_SHARD":
                # one bucket across the frozen unit, of trainable parameters alone
                # ([Note: packed gradients]: the root's frozen ``pos`` is left out too)
                assert got["all_reduces"] == 1, where
                assert got["grad_bytes"] == got["trainable_bytes"], where
                continue
            # every gradient byte moved belongs to a trainable unit
            assert got["grad_bytes"] == got["trainable_padded_bytes"], where
            state, held = got["state_at_backward_end"]
            if kind == "mlp":
                # never reached by backward: gathered for forward only, not prefetched;
                # ZeRO-1 keeps the gathered copy of a shard no step changed
                assert got["frozen_gathers"] == (strategy != "SHARD_OPTIM"), where
                assert state == "FORWARD", where
            else:
                # reached by backward: its post-backward ran and (ZeRO-3) freed it
                assert state == "BACKWARD_DONE", where
                if strategy == "FULL_SHARD":
                    assert got["frozen_gathers"] == 2 and held == 0, where


def test_requires_grad_changed_after_wrapping_is_an_error(one_rank) -> None:
    model = shardwrap.ShardedModule(parity.build_model("mlp"))
    batch = parity.batch_for("mlp", 0)
    next(model.parameters()).requires_grad_(False)
    with torch.no_grad():  # evaluation never reads the flags
        parity.loss_for("mlp", model, batch, 0)
    with pytest.raises(RuntimeError, match=r"body\.0\.weight: requires_grad changed to False"):
        parity.loss_for("mlp", model, batch, 0)


def _mixed_worker(rank: int, world_size: int, strategy: str) -> dict:
    model = parity.build_model("gpt")
    for name in MIXED:
        model.get_submodule(name).requires_grad_(False)
    model = parity.wrap_case(model, parity.Case(strategy=strategy, model="gpt"))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        with profile.profile_step(model) as prof:
            parity.loss_for("gpt", model, parity.batch_for("gpt", rank), step).backward()
            optim.step()
            optim.zero_grad()
    expected, padded = 0, 0
    for unit in model.units:
        layout = unit.handle.layout
        trainable = [
            sum(p.numel for i, p in zip(layout.params, layout.pieces(r)) if i.requires_grad)
            for r in range(layout.num_shards)
        ]
        frozen = not all(i.requires_grad for i in layout.params)
        chunk = max(trainable) if frozen else layout.shard_numel
        expected += 4 * layout.num_shards * chunk
        padded += 4 * layout.padded_numel
    return {"sent": prof.bytes("reduce_scatter", "grads"), "expected": expected, "padded": padded}


@pytest.mark.parametrize("world_size", MULTI_RANK_WORLD_SIZES)
def test_sharded_units_send_the_largest_ranks_trainable_part(world_size: int) -> None:
    for result in run_ranks(_mixed_worker, world_size, "FULL_SHARD"):
        assert result["sent"] == result["expected"], result
        # Less than the padded flat gradients: frozen weights stay home. How much less
        # depends on how evenly the trainable elements spread over the shards (2 ranks:
        # 73,600 bytes of 115,584; 3 ranks: 114,696 of 115,596).
        assert result["sent"] < result["padded"], result
