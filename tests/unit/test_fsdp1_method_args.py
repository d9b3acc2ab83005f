"""FSDP1's method arguments are acted on or warned about, never dropped: ``register_comm_hook``'s
``state`` must ask for what shardwrap does (the average over the data-parallel ranks);
``state_dict(keep_vars=True)`` and ``full_optim_state_dict(optim_input=...)`` warn once."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks import default_hooks

import shardwrap
from shardwrap.base.warn_once import forget_warned
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


def test_keep_vars_and_optim_input_warn_once(one_rank):
    model = shardwrap.ShardedModule(models.TinyGPT())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forget_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.state_dict(keep_vars=True)
        model.state_dict(keep_vars=True)
        shardwrap.ShardedModule.full_optim_state_dict(
            model, optimizer, optim_input=list(model.parameters())
        )
    messages = [str(w.message) for w in caught if w.category is UserWarning]
    assert len(messages) == 2, messages
    assert "keep_vars=True" in messages[0] and "not acted on" in messages[0]
    assert "optim_input" in messages[1] and "not acted on" in messages[1]
