"""``register_comm_hook``: torch's default hooks are accepted only with a state that asks
for what shardwrap does (the average over the data-parallel ranks), never dropped."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks import default_hooks

import shardwrap
from tests import models


def test_default_state_is_checked_not_dropped(one_rank):
    model = shardwrap.ShardedModule(models.TinyGPT())
    state = default_hooks.DefaultState(dist.group.WORLD)  # averages over the one rank
    model.register_comm_hook(state, default_hooks.allreduce_hook)
    model.register_comm_hook(None, default_hooks.reduce_scatter_hook)
    state.gradient_postdivide_factor = 4.0  # would scale the gradients by 1/4
    with pytest.raises(ValueError, match=r"gradient_postdivide_factor = 1.0 x 4.0 = 4.0"):
        model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    with pytest.raises(TypeError, match="state: expected None or torch's DefaultState"):
        model.register_comm_hook(object(), default_hooks.allreduce_hook)
