"""Ranks that disagree get RankDisagreementError on every rank, by default, not a crash.

See [Note: rank agreement] in shardwrap/comm/checks.py. Each case makes rank 1 differ
from rank 0 in one way; every rank must raise the named exception (so nothing hangs: the
harness fails a test whose ranks take longer than ``RANK_TIMEOUT_S``) naming rank 1 and
the first unit that differs. Agreeing ranks then train on: the pool stays usable.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwrap
from shardwrap.comm.collectives import RankDisagreementError
from shardwrap.policies import ModuleWrapPolicy
from tests import models
from tests.dist.harness import run_ranks


def _wrapped(rank: int, case: str) -> shardwrap.ShardedModule:
    torch.manual_seed(0)
    depth = 3 if case == "model size" and rank == 1 else 2
    gpt = models.TinyGPT(depth=depth)
    kinds = {models.Block, nn.Linear} if case == "policy" and rank == 1 else {models.Block}
    strategy = "SHARD_GRAD_OP" if case == "strategy" and rank == 1 else "FULL_SHARD"
    return shardwrap.ShardedModule(
        gpt, auto_wrap_policy=ModuleWrapPolicy(kinds), sharding_strategy=strategy
    )


def _wrap_worker(rank: int, world_size: int, case: str) -> str:
    try:
        _wrapped(rank, case)
    except RankDisagreementError as err:
        message = str(err)
    else:
        message = "no error"
    # The pool goes on: agreeing ranks wrap and train as usual afterwards.
    model = _wrapped(0, "none")
    models.gpt_loss(model, models.gpt_batch(rank)).backward()
    dist.barrier()
    return message


@pytest.mark.parametrize(
    ("case", "unit"),
    [
        # rank 1 also wraps each Linear: its third unit is one inside the first block
        ("policy", "first at unit #3 (rank 0: unit 'blocks.1': Block"),
        # rank 1 has a third block
        ("model size", "first at unit #4 (rank 0: no more units; rank 1: unit 'blocks.2'"),
        # rank 1 shards gradients only
        ("strategy", "first at unit #1 (rank 0: unit '(root)': TinyGPT"),
    ],
)
def test_disagreeing_wrap_raises_on_every_rank(case: str, unit: str) -> None:
    messages = run_ranks(_wrap_worker, 2, case)
    for message in messages:
        assert "ranks disagree on what to wrap" in message, message
        assert "rank 1 differs from rank 0 first at" in message, message
        assert unit in message, message
    if case == "strategy":
        assert "FULL_SHARD" in messages[0] and "SHARD_GRAD_OP" in messages[0]


class _Swappable(nn.Module):
    """Two blocks of equal size: run in swapped order, their collectives pair up silently."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = models.TinyGPT()

    def forward(self, idx: torch.Tensor, swap: bool = False) -> torch.Tensor:
        gpt = self.inner
        x = gpt.tok(idx) + gpt.pos[: idx.shape[1]]
        for block in reversed(gpt.blocks) if swap else gpt.blocks:
            x = block(x)
        return gpt.head(gpt.ln_f(x))


def _order_worker(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    model = shardwrap.ShardedModule(_Swappable(), auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    inputs = models.gpt_batch(rank)[0]
    model(inputs).sum().backward()  # agreeing steps pass the check
    messages = []
    try:
        model(inputs, swap=rank == 1).sum().backward()
    except RankDisagreementError as err:
        messages.append(str(err))
    model(inputs).sum().backward()  # and the model trains on once the ranks agree again
    dist.barrier()
    return messages


def test_units_run_in_another_order_raise_at_the_end_of_backward() -> None:
    for messages in run_ranks(_order_worker, 2):
        assert len(messages) == 1, messages
        assert "ranks disagree on the units run" in messages[0]
        assert "rank 1 differs from rank 0 first at unit #2 run" in messages[0]
        assert "'inner.blocks.0'" in messages[0] and "'inner.blocks.1'" in messages[0]
