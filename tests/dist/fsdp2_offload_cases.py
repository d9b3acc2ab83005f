"""Rank workers for tests/dist/test_fsdp2_offload.py: FSDP2's CPUOffloadPolicy on both sides."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh

import shardwrap
from shardwrap.fsdp2.state import state_of
from tests.dist import fsdp2_cases as fc


class StaleHostGrads:
    """The negative control's host staging: the offload path is taken, but every reduced
    gradient after the first is dropped on its way to the host, so the optimizer steps
    on the first step's gradients (a stale host copy)."""

    def __init__(self, staging) -> None:
        self.staging = staging
        self.first: torch.Tensor | None = None

    def to_host(self, device_tensor: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            self.first = self.staging.to_host(device_tensor)
        return self.first.clone()


def stale_grads_fully_shard(module: nn.Module, **kwargs) -> nn.Module:
    """shardwrap's ``fully_shard`` whose offloaded gradients reach the host stale."""
    shardwrap.fully_shard(module, **kwargs)
    grads = state_of(module).unit.handle.grads
    if grads.host_staging is None:
        raise RuntimeError("the control needs the offload path: no host staging")
    grads.host_staging = StaleHostGrads(grads.host_staging)
    return module


def compare(rank: int, world_size: int, script: fc.Script, stale: bool) -> list[str]:
    """torch's run, then shardwrap's (or the stale-gradient control's); their differences,
    and every way shardwrap's offloaded units do not keep host shards as FSDP2 does."""
    reference = fc.torch_run(rank, world_size, script)
    dist.barrier()
    shard = stale_grads_fully_shard if stale else shardwrap.fully_shard
    found = fc.differences(reference, fc.run_script(shard, rank, world_size, script))
    return found + offloaded_units(rank, world_size, script)


def offloaded_units(rank: int, world_size: int, script: fc.Script) -> list[str]:
    """Which units keep host shards (the offloading calls', unpinned) and which do not."""
    torch.manual_seed(0)
    model = fc.TinyModel()
    mesh = init_device_mesh("cpu", (world_size,))
    block_kw, root_kw = fc.mp_policies(script)
    for block in model.blocks:
        shardwrap.fully_shard(block, mesh=mesh, **block_kw)
    shardwrap.fully_shard(model, mesh=mesh, **root_kw)
    found = []
    for name, module, offload in [
        ("root", model, script.root_offload),
        *((f"block{i}", b, script.offload) for i, b in enumerate(model.blocks)),
    ]:
        staging = state_of(module).unit.handle.host_staging
        if (staging is not None) != (offload == "cpu"):
            found.append(f"{name}: host staging {staging!r} for offload {offload!r}")
        elif staging is not None and staging.pin_memory:
            found.append(f"{name}: pinned, though pin_memory=False")
    return found


def pinning_without_cuda(rank: int, world_size: int) -> dict[str, str]:
    """What ``CPUOffloadPolicy()`` (pin_memory=True) does without CUDA, on each side."""
    mesh = init_device_mesh("cpu", (world_size,))
    found = {}
    for side, shard in (("torch", torch_fsdp.fully_shard), ("shardwrap", shardwrap.fully_shard)):
        torch.manual_seed(0)
        try:
            shard(fc.TinyModel(), mesh=mesh, offload_policy=torch_fsdp.CPUOffloadPolicy())
            found[side] = "accepted"
        except (RuntimeError, ValueError) as error:
            found[side] = f"{type(error).__name__}: {error}"
    return found
