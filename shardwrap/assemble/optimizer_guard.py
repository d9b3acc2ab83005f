"""Catch an optimizer built before wrapping (it holds parameters the model no longer uses).

Wrapping replaces every managed parameter by this rank's shard view. An optimizer built
from the original parameters would step tensors that no forward reads any more: training
would silently do nothing. The original parameters are remembered (weakly) at wrap time,
and every optimizer step (while any model lives: [Note: one optimizer-step dispatcher] in
core/optimizer_step.py) raises if the optimizer still holds one.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..core import optimizer_step

# id -> original parameter replaced by wrapping; entries vanish with their parameters.
_RETIRED: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()


def retire(params: list[nn.Parameter]) -> None:
    """Remember ``params`` as replaced by shard views; check every optimizer step for them."""
    for param in params:
        _RETIRED[id(param)] = param
    optimizer_step.add_check(_check_optimizer)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if not _RETIRED:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if _RETIRED.get(id(param)) is param:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds a parameter of shape "
                    f"{tuple(param.shape)} that ShardedModule replaced when wrapping: the "
                    "optimizer was built before wrapping. Build it after ShardedModule(...) "
                    "from the wrapped model's parameters()."
                )
