"""No optimizer step hook outlives the last model or store that needs it.

[Note: one optimizer-step dispatcher] in shardwrap/core/optimizer_step.py: one global pre-hook
while any model or store lives, one pre/post pair on each optimizer that stepped their
shards. torch keeps them in readable dicts (``torch.optim.optimizer``'s global ones and each
optimizer's own), so the test counts the hooks shardwrap's modules put there, while the
models live and after the last is collected (the optimizers outlive them).

Negative control (in the suite): with the dispatcher's clean-up made a no-op, the same
count after the models are gone is not zero.
"""

from __future__ import annotations

import gc

import torch
from torch.optim import optimizer as optim_module

import shardwrap
from shardwrap.core import optimizer_step
from tests import models


def shardwrap_hooks(optimizers: list[torch.optim.Optimizer]) -> list[str]:
    """The step hooks of shardwrap's modules: the global ones and those on ``optimizers``."""
    tables = {
        "global pre": optim_module._global_optimizer_pre_hooks,
        "global post": optim_module._global_optimizer_post_hooks,
    }
    for index, optimizer in enumerate(optimizers):
        tables[f"optimizer {index} pre"] = optimizer._optimizer_step_pre_hooks
        tables[f"optimizer {index} post"] = optimizer._optimizer_step_post_hooks
    return [
        f"{where}: {hook.__module__}.{hook.__qualname__}"
        for where, table in tables.items()
        for hook in table.values()
        if getattr(hook, "__module__", "").startswith("shardwrap")
    ]


def _train_and_drop(tmp_path) -> list[torch.optim.Optimizer]:
    """A ZeRO-3, a ZeRO-1 and a DiskOffload model, one step each; the optimizers outlive them."""
    built = [
        shardwrap.ShardedModule(models.MLP()),
        shardwrap.ShardedModule(models.MLP(), sharding_strategy="SHARD_OPTIM"),
        shardwrap.ShardedModule(models.MLP(), cpu_offload=shardwrap.DiskOffload(str(tmp_path))),
    ]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in built]
    for model, optimizer in zip(built, optimizers, strict=True):
        models.mlp_loss(model, models.mlp_batch(0)).backward()
        optimizer.step()
    live = shardwrap_hooks(optimizers)
    assert len(live) == 1 + 2 * len(optimizers), live  # the global one, a pair per optimizer
    del built, model
    gc.collect()
    return optimizers


def test_no_step_hook_is_left_once_the_models_are_gone(one_rank, tmp_path) -> None:
    gc.collect()
    assert shardwrap_hooks([]) == []  # nothing left by an earlier test either
    optimizers = _train_and_drop(tmp_path)
    assert shardwrap_hooks(optimizers) == []
    assert optimizer_step.hooked_optimizers() == []


def test_the_count_sees_hooks_left_behind(one_rank, tmp_path, monkeypatch) -> None:
    # The negative control: a dispatcher that never removes its hooks.
    monkeypatch.setattr(optimizer_step, "_unhook_unowned", lambda: None)
    optimizers = _train_and_drop(tmp_path)
    try:
        assert len(shardwrap_hooks(optimizers)) == 1 + 2 * len(optimizers)
    finally:
        monkeypatch.undo()
        optimizer_step._unhook_unowned()  # clean up for the tests that follow
    assert shardwrap_hooks(optimizers) == []
