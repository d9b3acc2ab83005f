"""The most loaded rank of a module's estimate, found without visiting every rank."""

from __future__ import annotations

import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardwrap.layout.flat import FlatLayout
from shardwrap.planner.estimate import estimate_memory
from shardwrap.planner.shards import worst_trainable_shard
from shardwrap.wrap import ModuleWrapPolicy


def _brute_worst(layouts: list[FlatLayout]) -> int:
    n = max(layout.num_shards for layout in layouts)
    return max(
        sum(
            piece.numel
            for layout in layouts
            for info, piece in zip(layout.params, layout.pieces(r % layout.num_shards))
            if info.requires_grad
        )
        for r in range(n)
    )


PARAMS = st.lists(st.tuples(st.integers(0, 60), st.booleans()), max_size=6)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 40), units=st.lists(st.tuples(PARAMS, st.booleans()), min_size=1, max_size=4)
)
def test_worst_rank_matches_every_rank(n, units):
    layouts = [
        FlatLayout.build(
            [(f"p{i}", (numel,), grad) for i, (numel, grad) in enumerate(params)], 1 if whole else n
        )
        for params, whole in units
    ]
    assert worst_trainable_shard(layouts) == _brute_worst(layouts)


def test_a_module_on_32768_ranks_takes_well_under_a_second():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)], nn.LayerNorm(256))
    model[3].requires_grad_(False)
    policy = ModuleWrapPolicy({nn.Linear})
    small = estimate_memory(model, world_size=7, auto_wrap_policy=policy)
    every_rank = [
        estimate_memory(model, world_size=7, auto_wrap_policy=policy, rank=r) for r in range(7)
    ]
    for stage, est in enumerate(small):
        assert est.bytes("gradients") == max(e[stage].bytes("gradients") for e in every_rank)
    start = time.perf_counter()
    estimate_memory(model, world_size=32768, auto_wrap_policy=policy)
    assert time.perf_counter() - start < 0.5
