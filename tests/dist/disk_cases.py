"""Training with DiskOffload against the same training in memory."""

from __future__ import annotations

import copy
import os

import torch

import shardwrap
from shardwrap.checkpoint import load_checkpoint, save_checkpoint
from shardwrap.offload.disk import is_file_backed
from tests import models
from tests.dist.parity import build_model, wrap_policy


def disk_matches_memory(rank: int, world_size: int, path: str, strategy: str) -> list[str]:
    """Three AdamW steps on disk and in memory: equal bit for bit. Returns the files left."""
    model = build_model("gpt")
    kwargs = {"sharding_strategy": strategy, "auto_wrap_policy": wrap_policy("gpt")}
    in_memory = shardwrap.ShardedModule(copy.deepcopy(model), **kwargs)
    on_disk = shardwrap.ShardedModule(model, cpu_offload=shardwrap.DiskOffload(path), **kwargs)
    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in (in_memory, on_disk)
    ]
    for step in range(3):
        batch = models.gpt_batch(100 * step + rank)
        for model_, optim in zip((in_memory, on_disk), optimizers):
            models.gpt_loss(model_, batch, use_extra=step % 2 == 1).backward()
            optim.step()
            optim.zero_grad()
        for (name, kept), (_, mapped) in zip(
            in_memory.named_parameters(), on_disk.named_parameters()
        ):
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


SMALL_SUB_GROUP = 97  # odd and small: most parameters are cut into pieces at odd offsets


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _adam_amsgrad(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01, weight_decay=0.05, amsgrad=True)


def _assert_same_optimizer_state(kept: dict, other: dict) -> None:
    assert kept["param_groups"] == other["param_groups"]
    assert kept["state"].keys() == other["state"].keys()
    for index, state in kept["state"].items():
        assert state.keys() == other["state"][index].keys()
        for name, value in state.items():
            torch.testing.assert_close(other["state"][index][name], value, rtol=0, atol=0)


def streamed_matches_memory(
    rank: int, world_size: int, path: str, strategy: str, make_optimizer
) -> list[str]:
    """Memory, disk in one sub-group and disk in small sub-groups train bit for bit alike.

    With an lr schedule, weight decay, gradient clipping, and an optimizer state_dict
    round trip half-way. Returns the files left in the disk stores' directories.
    """
    model = build_model("gpt")
    kwargs = {"sharding_strategy": strategy, "auto_wrap_policy": wrap_policy("gpt")}
    runs = [shardwrap.ShardedModule(copy.deepcopy(model), **kwargs)]
    for size in (1_000_000_000, SMALL_SUB_GROUP):
        offload = shardwrap.DiskOffload(path, sub_group_size=size)
        runs.append(shardwrap.ShardedModule(copy.deepcopy(model), cpu_offload=offload, **kwargs))
    optimizers = [make_optimizer(m.parameters()) for m in runs]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in optimizers]
    for step in range(4):
        batch = models.gpt_batch(100 * step + rank)
        for model_, optim, scheduler in zip(runs, optimizers, schedulers, strict=True):
            models.gpt_loss(model_, batch, use_extra=step % 2 == 1).backward()
            model_.clip_grad_norm_(0.5)
            optim.step()
            scheduler.step()
            optim.zero_grad()
            if step == 1:
                optim.load_state_dict(copy.deepcopy(optim.state_dict()))
        for optim in optimizers[1:]:  # on disk from the first step on (the reload put it back)
            states = [t for s in optim.state.values() for k, t in s.items() if k != "step"]
            assert states and all(is_file_backed(t) for t in states) != (step == 1)
        for other in runs[1:]:
            for (name, kept), (_, mine) in zip(
                runs[0].named_parameters(), other.named_parameters()
            ):
                torch.testing.assert_close(mine, kept, rtol=0, atol=0, msg=name)
        for optim in optimizers[1:]:
            _assert_same_optimizer_state(optimizers[0].state_dict(), optim.state_dict())
    one_group, streamed = runs[1].disk_store, runs[2].disk_store
    assert one_group.num_sub_groups(optimizers[1]) == 1
    local_numel = sum(p.numel() for p in runs[2].parameters() if p.requires_grad)
    assert streamed.num_sub_groups(optimizers[2]) >= local_numel // SMALL_SUB_GROUP
    states = [t for s in optimizers[2].state.values() for k, t in s.items() if k != "step"]
    assert states and all(is_file_backed(t) for t in states)
    return os.listdir(one_group.directory) + os.listdir(streamed.directory)


def streamed_cases(rank: int, world_size: int, path: str, checkpoints: str) -> list[str]:
    """ZeRO-3 with AdamW, ZeRO-1 with Adam(amsgrad), and checkpoints, in one spawn."""
    left = streamed_matches_memory(rank, world_size, path, "FULL_SHARD", _adamw)
    left += streamed_matches_memory(rank, world_size, path, "SHARD_OPTIM", _adam_amsgrad)
    checkpoints_cross_between_disk_and_memory(rank, world_size, path, checkpoints)
    return left


def _gpt_run(path: str | None, size: int = SMALL_SUB_GROUP):
    offload = None if path is None else shardwrap.DiskOffload(path, sub_group_size=size)
    model = shardwrap.ShardedModule(
        build_model("gpt"), cpu_offload=offload, auto_wrap_policy=wrap_policy("gpt")
    )
    return model, _adamw(model.parameters())


def _train(model, optim, rank: int, steps: range) -> None:
    for step in steps:
        models.gpt_loss(model, models.gpt_batch(100 * step + rank)).backward()
        optim.step()
        optim.zero_grad()


def checkpoints_cross_between_disk_and_memory(
    rank: int, world_size: int, path: str, checkpoints: str
) -> None:
    """Save from memory, resume streamed on disk; save streamed, resume in memory: exact."""
    saved = {name: os.path.join(checkpoints, name) for name in ("memory", "disk")}
    reference, ref_optim = _gpt_run(None)
    _train(reference, ref_optim, rank, range(2))
    save_checkpoint(saved["memory"], reference, ref_optim)
    _train(reference, ref_optim, rank, range(2, 4))
    streamed, optim = _gpt_run(path)
    _train(streamed, optim, rank, range(2))
    save_checkpoint(saved["disk"], streamed, optim)
    for source, target in (("memory", path), ("disk", None)):
        model, optim = _gpt_run(target)
        load_checkpoint(saved[source], model, optim)
        _train(model, optim, rank, range(2, 4))
        for (name, kept), (_, mine) in zip(reference.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(mine, kept, rtol=0, atol=0, msg=f"{source}: {name}")
