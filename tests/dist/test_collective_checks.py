"""Debug mode: a rank that takes another branch raises on every rank instead of hanging."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

import shardwrap
from shardwrap.assemble.root import root_of
from shardwrap.comm.collectives import CollectiveMismatchError
from shardwrap.policies import ModuleWrapPolicy
from tests import models
from tests.dist.harness import run_ranks
from tests.dist.parity import build_model


def _diverging_worker(rank: int, world_size: int) -> str:
    gpt = build_model("gpt")
    policy = ModuleWrapPolicy({models.Block, nn.Linear})
    model = shardwrap.ShardedModule(gpt, auto_wrap_policy=policy)
    # agreeing ranks pass the check and train as usual
    with model.checking_collectives(timeout_s=30):
        models.gpt_loss(model, models.gpt_batch(rank)).backward()
    checked = root_of(model).runtime.world_comm.checker
    assert checked is None  # the context manager switched the checks off again
    model.set_collective_checks(True, timeout_s=30)
    try:
        # rank 1 alone takes the branch through the wrapped "extra" unit
        models.gpt_loss(model, models.gpt_batch(rank), use_extra=rank == 1).backward()
    except CollectiveMismatchError as err:
        dist.barrier()
        return str(err)
    return "no error"


def test_divergent_branch_is_reported_on_every_rank() -> None:
    messages = run_ranks(_diverging_worker, 2)
    for message in messages:
        assert "diverged first at rank 1" in message
        assert "unit 'extra'" in message
