"""What a wrapped model answers for its options compares equal to torch's own objects.

FSDP1 code compares ``model.sharding_strategy`` with torch's ``ShardingStrategy`` and
``unit.mixed_precision`` with the ``MixedPrecision`` it passed (torch's wrap tests do); a
model wrapped by shardwrap holds shardwrap's records and members, which must answer alike.
"""

from __future__ import annotations

import enum

import torch
from torch.distributed import fsdp as torch_fsdp

from shardwrap import FullyShardedDataParallel as FSDP
from shardwrap import options
from tests import models


def test_a_model_wrapped_with_torchs_options_answers_equal_to_them(one_rank):
    mp = torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16)
    model = FSDP(
        models.TinyGPT(),
        sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
        backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_POST,
        mixed_precision=mp,
        cpu_offload=torch_fsdp.CPUOffload(offload_params=False),
    )
    assert isinstance(model.sharding_strategy, options.ShardingStrategy)
    assert model.sharding_strategy == torch_fsdp.ShardingStrategy.SHARD_GRAD_OP
    assert torch_fsdp.ShardingStrategy.SHARD_GRAD_OP == model.sharding_strategy
    assert model.sharding_strategy != torch_fsdp.ShardingStrategy.FULL_SHARD
    assert model.backward_prefetch == torch_fsdp.BackwardPrefetch.BACKWARD_POST
    assert model.mixed_precision == mp and mp == model.mixed_precision
    assert model.mixed_precision != torch_fsdp.MixedPrecision(param_dtype=torch.float16)
    assert model.cpu_offload == torch_fsdp.CPUOffload(offload_params=False)
    # equal members hash alike, so either finds the other in a dict
    table = {torch_fsdp.ShardingStrategy.SHARD_GRAD_OP: "zero2"}
    assert table[model.sharding_strategy] == "zero2"


def test_equality_stays_within_the_same_concept():
    strategy = options.ShardingStrategy.FULL_SHARD
    lookalike = enum.Enum("ShardingStrategy", ["FULL_SHARD"])  # the name, not torch's
    assert strategy != lookalike.FULL_SHARD and lookalike.FULL_SHARD != strategy
    assert strategy == options.ShardingStrategy.FULL_SHARD
    assert strategy != options.ShardingStrategy.NO_SHARD
    assert strategy != options.StateDictType.FULL_STATE_DICT  # another enum, same-ish name
    assert strategy != "FULL_SHARD"
    assert options.MixedPrecision() == options.MixedPrecision()
    assert options.MixedPrecision() != options.CPUOffload()
