"""Bad input gets a clear error naming the problem (one-rank gloo group, in process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwrap
from shardwrap.assemble.sharding import check_one_device
from shardwrap.policies import ModuleWrapPolicy
from tests import models


def test_no_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        shardwrap.ShardedModule(models.MLP())


def test_wrapped_twice(one_rank):
    inner = shardwrap.ShardedModule(models.MLP())
    with pytest.raises(ValueError, match="wrapped twice"):
        shardwrap.ShardedModule(inner)
    mlp = models.MLP()
    shardwrap.ShardedModule(mlp)
    with pytest.raises(ValueError, match="already managed.*wrapped twice"):
        shardwrap.ShardedModule(mlp)


@pytest.mark.parametrize("policy", [{nn.Linear}, 3, "transformer"])
def test_policy_of_wrong_type(one_rank, policy):
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        shardwrap.ShardedModule(models.MLP(), auto_wrap_policy=policy)


def test_module_wrap_policy_needs_module_classes():
    with pytest.raises(TypeError, match="not an nn.Module subclass"):
        ModuleWrapPolicy({int})


def test_unknown_strategy(one_rank):
    with pytest.raises(ValueError, match="sharding_strategy: unknown strategy 'ZERO_9'"):
        shardwrap.ShardedModule(models.MLP(), sharding_strategy="ZERO_9")


def test_torch_strategy_is_accepted_by_name(one_rank):
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    model = shardwrap.ShardedModule(models.MLP(), sharding_strategy=TorchStrategy.SHARD_GRAD_OP)
    assert model.sharding_strategy is shardwrap.ShardingStrategy.SHARD_GRAD_OP
    hybrid = shardwrap.ShardingStrategy.parse(TorchStrategy._HYBRID_SHARD_ZERO2)
    assert hybrid is shardwrap.ShardingStrategy.HYBRID_SHARD_ZERO2


def test_mixed_devices_are_named():
    records = [
        SimpleNamespace(fqn="a.weight", param=SimpleNamespace(device=torch.device("cpu"))),
        SimpleNamespace(fqn="b.weight", param=SimpleNamespace(device=torch.device("cuda", 0))),
    ]
    with pytest.raises(ValueError, match=r"mixed devices \(a.weight on cpu, b.weight on cuda:0\)"):
        check_one_device(records)


def test_hybrid_layout_must_tile(one_rank):
    with pytest.raises(ValueError, match="does not tile the world of 1 ranks"):
        shardwrap.hybrid_process_groups(3)
    with pytest.raises(ValueError, match="process_group=\\(shard_group, replicate_group\\)"):
        shardwrap.ShardedModule(models.MLP(), sharding_strategy="HYBRID_SHARD")


def test_bad_flag_types(one_rank):
    with pytest.raises(TypeError, match="sync_module_states"):
        shardwrap.ShardedModule(models.MLP(), sync_module_states="yes")
    with pytest.raises(ValueError, match="backward_prefetch"):
        shardwrap.ShardedModule(models.MLP(), backward_prefetch="SOMETIMES")
    with pytest.raises(TypeError, match="ignored_modules"):
        shardwrap.ShardedModule(models.MLP(), ignored_modules=["body"])


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


def test_meta_module_without_reset_parameters_is_named(one_rank):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _NoReset())
    with pytest.raises(ValueError, match=r"module '1' \(_NoReset\) has \['scale'\] on the meta"):
        shardwrap.ShardedModule(model)
