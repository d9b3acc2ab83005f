"""Training with DiskOffload against the same training in memory."""

from __future__ import annotations

import copy
import os

import torch

import shardwrap
from shardwrap.offload import is_file_backed
from tests import models
from tests.dist.parity import build_model, wrap_policy


def disk_matches_memory(rank: int, world_size: int, path: str, strategy: str) -> list[str]:
    """Three AdamW steps on disk and in memory: equal bit for bit. Returns the files left."""
    model = build_model("gpt")
    kwargs = {"sharding_strategy": strategy, "auto_wrap_policy": wrap_policy("gpt")}
    in_memory = shardwrap.ShardedModule(copy.deepcopy(model), **kwargs)
    on_disk = shardwrap.ShardedModule(model, cpu_offload=shardwrap.DiskOffload(path), **kwargs)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in (in_memory, on_disk)]
    for step in range(3):
        batch = models.gpt_batch(100 * step + rank)
        for model_, optim in zip((in_memory, on_disk), optimizers):
            models.gpt_loss(model_, batch, use_extra=step % 2 == 1).backward()
            optim.step()
            optim.zero_grad()
        for (name, kept), (_, mapped) in zip(in_memory.named_parameters(), on_disk.named_parameters()):
            torch.testing.assert_close(mapped, kept, rtol=0, atol=0, msg=name)
    handles = [u.handle for u in on_disk.units if u.handle is not None]
    assert all(is_file_backed(h.flat_shard) for h in handles)
    states = [t for s in optimizers[1].state.values() for k, t in s.items() if k != "step"]
    assert states and all(is_file_backed(t) for t in states)
    directory = on_disk.disk_store.directory
    assert os.path.isdir(directory)
    return os.listdir(directory)  # mapped files are unlinked at once: nothing to leave behind


def both_strategies(rank: int, world_size: int, path: str) -> list[str]:
    """ZeRO-3 and ZeRO-1 (whose gathered copy stays in memory) in one spawn."""
    left = []
    for strategy in ("FULL_SHARD", "SHARD_OPTIM"):
        left += disk_matches_memory(rank, world_size, path, strategy)
    return left
