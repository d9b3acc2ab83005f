"""Rank workers for tests/dist/test_fsdp2_door.py: FSDPModule's surface and install()."""

from __future__ import annotations

import torch
import torch.distributed._composable.fsdp as composable
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardwrap
from tests.dist import fsdp2_cases as fc


def surface(rank: int, world_size: int) -> dict:
    """isinstance, the class name, unshard/reshard and install()'s rebinding."""
    found: dict = {}
    shardwrap.install()
    try:
        found["rebound"] = (
            torch_fsdp.fully_shard is shardwrap.fully_shard
            and composable.fully_shard is shardwrap.fully_shard
        )
        torch.manual_seed(0)
        model = fc.TinyModel()
        whole = {n: p.detach().clone() for n, p in model.named_parameters()}
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        for block in model.blocks:
            torch_fsdp.fully_shard(block, mesh=mesh)
        torch_fsdp.fully_shard(model, mesh=mesh)
        # install() rebinds torch's state-dict functions too; a door model is plain FSDP2
        # to them (DTensor parameters), so they must stay torch's for it.
        state = dsd.get_model_state_dict(model)
        full = dsd.get_model_state_dict(model, options=dsd.StateDictOptions(full_state_dict=True))
        found["dsd"] = (
            state.keys() == full.keys() == model.state_dict().keys()
            and all(isinstance(v, DTensor) for v in state.values())
            and all(
                not isinstance(full[k], DTensor) and torch.equal(full[k], v.full_tensor())
                for k, v in state.items()
            )
        )
        found["isinstance"] = (
            isinstance(model, torch_fsdp.FSDPModule),
            isinstance(model.blocks[0], shardwrap.FSDPModule),
            isinstance(model, fc.TinyModel),
            type(model).__name__,
        )
    finally:
        shardwrap.uninstall()
    found["restored"] = torch_fsdp.fully_shard is not shardwrap.fully_shard
    found["torch_isinstance_after"] = isinstance(model, torch_fsdp.FSDPModule)
    found["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    handle = model.blocks[0].unshard(async_op=True)
    handle.wait()
    block_params = dict(model.blocks[0].named_parameters())
    found["unsharded"] = all(
        not isinstance(p, DTensor) and torch.equal(p, whole[f"blocks.0.{n}"])
        for n, p in block_params.items()
    )
    model.blocks[0].reshard()
    found["resharded"] = all(isinstance(p, DTensor) for p in model.blocks[0].parameters())
    try:
        model.blocks[0].set_requires_gradient_sync(False)
        found["partial_sync"] = "accepted"
    except NotImplementedError as error:
        found["partial_sync"] = str(error)
    return found


def resharding(rank: int, world_size: int, block_setting: bool | None) -> dict:
    """What stays gathered after a forward: the root by FSDP2's default, the blocks as
    ``reshard_after_forward`` says (None: freed); after backward, nothing."""
    from shardwrap.fsdp2.state import state_of

    torch.manual_seed(0)
    model = fc.TinyModel()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        shardwrap.fully_shard(block, mesh=mesh, reshard_after_forward=block_setting)
    shardwrap.fully_shard(model, mesh=mesh)

    def gathered() -> dict[str, bool]:
        held = {"root": state_of(model).unit.handle.full_storage_bytes > 0}
        for index, block in enumerate(model.blocks):
            held[f"block{index}"] = state_of(block).unit.handle.full_storage_bytes > 0
        return held

    idx, target = fc.batch(0, rank)
    loss = torch.nn.functional.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1))
    after_forward = gathered()
    loss.backward()
    return {"after_forward": after_forward, "after_backward": gathered()}


def stepped_units(rank: int, world_size: int) -> dict[str, int]:
    """Optimizer steps the step runtime noted per unit after one SGD step (each unit must
    count one: the note is what marks its gathered copy stale when a step bumps no
    version, [Note: optimizer steps that bump no version] in flat_param.py)."""
    from shardwrap.fsdp2.state import state_of

    model = fc.sharded_tiny_model(world_size)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    idx, target = fc.batch(0, rank)
    loss = torch.nn.functional.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1))
    loss.backward()
    optim.step()
    units = {"root": model, **{f"block{i}": b for i, b in enumerate(model.blocks)}}
    return {name: state_of(m).unit.handle.shard_version[1] for name, m in units.items()}
