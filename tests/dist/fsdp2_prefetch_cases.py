"""Rank workers for tests/dist/test_fsdp2_prefetch.py: FSDP2's explicit prefetch."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardwrap
from shardwrap.fsdp2.state import state_of
from tests.dist import fsdp2_cases as fc

EXPLICIT = fc.Script(explicit_prefetch=True)


def compare(rank: int, world_size: int) -> list[str]:
    """torch's FSDP2 example's prefetch settings on both sides: their differences."""
    reference = fc.torch_run(rank, world_size, EXPLICIT)
    dist.barrier()
    return fc.differences(
        reference, fc.run_script(shardwrap.fully_shard, rank, world_size, EXPLICIT)
    )


def _issued(module: nn.Module) -> bool:
    """Whether ``module``'s unit has its all-gather issued or landed (current)."""
    handle = state_of(module).unit.handle
    return handle.gather_in_flight or handle.full_is_current


def probe(rank: int, world_size: int, explicit: bool) -> dict[str, list[bool]]:
    """Per step, whether block 1's gather is issued while block 0 computes its forward,
    and block 0's while block 1 computes its backward. ``explicit``: block 0 prefetches
    block 1 in forward, and block 1 prefetches nothing in backward."""
    model = fc.sharded_tiny_model(world_size)
    first, second = model.blocks
    if explicit:
        first.set_modules_to_forward_prefetch([second])
        second.set_modules_to_backward_prefetch([])
    seen: dict[str, list[bool]] = {"forward": [], "backward": []}
    # Inside each block's pass: after its own pre-forward / pre-backward gather.
    first.ln.register_forward_pre_hook(lambda *_: seen["forward"].append(_issued(second)))
    second.down.register_full_backward_pre_hook(lambda *_: seen["backward"].append(_issued(first)))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        idx, target = fc.batch(step, rank)
        F.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1)).backward()
        optim.step()
        optim.zero_grad()
    return seen


def refusals(rank: int, world_size: int) -> list[str]:
    """What a list of modules fully_shard was not called on gets."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    shardwrap.fully_shard(model[0], mesh=mesh)
    shardwrap.fully_shard(model, mesh=mesh)
    found = []
    for bad in ([model[1]], model[0]):
        try:
            model.set_modules_to_forward_prefetch(bad)
        except TypeError as error:
            found.append(str(error))
    return found
