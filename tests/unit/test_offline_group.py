"""A ``process_group`` that answers only ``rank()`` and ``size()`` (torch's test
``DummyProcessGroup``) wraps and shards, as under FSDP1; it cannot communicate.

No process group is initialised here: the point is that wrapping needs none. A group of
one trains (it needs no collective) and equals the unwrapped model bit for bit; a bigger
one shards as the rank it names and refuses the first collective by name.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks

import shardwrap
from shardwrap import FullyShardedDataParallel as FSDP
from shardwrap.options import ShardingStrategy
from shardwrap.wrap import size_based_auto_wrap_policy


class RankAndSize:
    """What torch's ``DummyProcessGroup`` offers FSDP1: a rank and a size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    )


ALLREDUCE = default_hooks.allreduce_hook
# Wraps the inner Sequential (60 parameters) only: each Linear has 30.
POLICY = functools.partial(size_based_auto_wrap_policy, min_num_params=40)


def test_a_group_of_one_wraps_and_trains_as_the_plain_model():
    plain = _model()
    reference = copy.deepcopy(plain)
    group = RankAndSize(0, 1)
    model = FSDP(plain, process_group=group, auto_wrap_policy=POLICY)
    assert model.process_group is group and (model.rank, model.world_size) == (0, 1)
    assert isinstance(plain[2], FSDP) and not isinstance(plain[0], FSDP)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    for m in (model, reference):
        optim = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x).pow(2).sum().backward()
        optim.step()
    with FSDP.summon_full_params(model):
        for mine, theirs in zip(plain.parameters(), reference.parameters(), strict=True):
            assert torch.equal(mine, theirs)


def test_a_bigger_group_shards_as_its_rank_and_refuses_to_communicate():
    full = [p.detach().clone().reshape(-1) for p in _model().parameters()]
    shards = []
    for rank in (0, 1):
        model = FSDP(_model(), process_group=RankAndSize(rank, 2), auto_wrap_policy=POLICY)
        assert (model.rank, model.world_size) == (rank, 2)
        shards.append([p.detach().reshape(-1) for p in model.parameters()])
    # each rank holds its own piece: rank 0's, then rank 1's, make every parameter
    for whole, first, second in zip(full, *shards, strict=True):
        assert torch.equal(torch.cat([first, second]), whole)
    with pytest.raises(RuntimeError, match="RankAndSize .rank and size only. cannot communicate"):
        model(torch.randn(3, 5))


def test_checkpoints_and_hooks_over_a_default_group_still_see_the_offline_one(one_rank, tmp_path):
    """A default group exists, but the model's own group is offline: a checkpoint (which
    runs over the default group) refuses by name, not with a disagreement of ranks."""
    model = FSDP(_model(), process_group=RankAndSize(1, 2))
    with pytest.raises(RuntimeError, match="cannot communicate"):
        shardwrap.save_checkpoint(tmp_path / "ckpt", model)
    alone = FSDP(_model(), process_group=RankAndSize(0, 1))
    alone.register_comm_hook(default_hooks.DefaultState(RankAndSize(0, 1)), ALLREDUCE)
    with pytest.raises(ValueError, match="has 2 ranks, but this model averages"):
        alone.register_comm_hook(default_hooks.DefaultState(RankAndSize(0, 2)), ALLREDUCE)


def test_torchs_own_backend_objects_are_not_offline_groups():
    backend = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    with pytest.raises((TypeError, ValueError), match="process_group"):
        FSDP(_model(), process_group=backend)


def test_what_an_offline_group_cannot_do_is_refused_at_wrap():
    with pytest.raises(ValueError, match="can shard one flat group, not HYBRID_SHARD"):
        FSDP(
            _model(),
            process_group=RankAndSize(0, 2),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        )
    with pytest.raises(ValueError, match=r"rank\(\) = 2, size\(\) = 2"):
        FSDP(_model(), process_group=RankAndSize(2, 2))
