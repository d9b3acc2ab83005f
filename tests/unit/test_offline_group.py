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
from torch import nn

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


POLICY = functools.partial(
    size_based_auto_wrap_policy, min_num_params=40
)  # the inner Sequential only


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
    plain = _model()
    numels = [p.numel() for p in plain.parameters()]
    model = FSDP(plain, process_group=RankAndSize(1, 2), auto_wrap_policy=POLICY)
    assert (model.rank, model.world_size) == (1, 2)
    assert sum(p.numel() for p in model.parameters()) < sum(numels)  # rank 1's half
    with pytest.raises(RuntimeError, match="RankAndSize .rank and size only. cannot communicate"):
        model(torch.randn(3, 5))


def test_what_an_offline_group_cannot_do_is_refused_at_wrap():
    with pytest.raises(ValueError, match="can shard one flat group, not HYBRID_SHARD"):
        FSDP(
            _model(),
            process_group=RankAndSize(0, 2),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        )
    with pytest.raises(ValueError, match=r"rank\(\) = 2, size\(\) = 2"):
        FSDP(_model(), process_group=RankAndSize(2, 2))
