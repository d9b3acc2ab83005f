"""shardwrap's checkpoints of FSDP2-door models: one format for both doors, any world size.

The FSDP2 door (``shardwrap.fully_shard``) saves and loads with ``shardwrap.save_checkpoint``
/ ``load_checkpoint`` as the FSDP1 door (``ShardedModule``) does; its parameters and AdamW
state are ``Shard(0)`` DTensors, saved from and loaded into their local chunks. Four calls
on fresh worlds, in order:

1. world 2, FSDP2 door: train 2 AdamW steps, save; then one more step (the reference).
2. world 3, FSDP2 door: load; every parameter and every AdamW state (``full_tensor()``)
   equals what world 2 held after step 2, bit for bit; save again at world 3.
3. world 2, FSDP1 door: load world 3's FSDP2 checkpoint (the parameters equal step 2's),
   save it as the FSDP1 door's checkpoint.
4. world 2, FSDP2 door: load the FSDP1 door's checkpoint: parameters and AdamW state equal
   step 2's again, and the third step gives the reference's parameters bit for bit (at 2
   ranks a gradient sum has two terms, so the step is the same arithmetic).

Negative control (run once, 2026-12-03): the FSDP1 door loading the model without its
optimizer fails call 4 (its checkpoint then lacks every AdamW state).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import shardwrap
from shardwrap.wrap import ModuleWrapPolicy
from tests.dist import fsdp2_cases as fc
from tests.dist.harness import run_ranks

STEPS_BEFORE_SAVE = 2


def _door_model(world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fc.TinyModel()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for block in model.blocks:
        shardwrap.fully_shard(block, mesh=mesh)
    shardwrap.fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=fc.LR, weight_decay=0.1)


def _fsdp1_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = shardwrap.ShardedModule(
        fc.TinyModel(),
        sharding_strategy="FULL_SHARD",
        auto_wrap_policy=ModuleWrapPolicy({fc.Block}),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=fc.LR, weight_decay=0.1)


def _step(model, optim, step: int, rank: int) -> None:
    idx, target = fc.batch(step, rank)
    F.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1)).backward()
    optim.step()
    optim.zero_grad()


def _door_state(model, optim) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state, whole (``full_tensor()``), by parameter name."""
    found = {}
    for name, param in model.named_parameters():
        found[name] = param.full_tensor().detach().clone()
        for key, value in optim.state[param].items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            found[f"{name}/{key}"] = whole.detach().clone()
    return found


def _fsdp1_params(model) -> dict[str, torch.Tensor]:
    with shardwrap.ShardedModule.summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_and_save(rank: int, world_size: int, folder: str) -> dict:
    model, optim = _door_model(world_size)
    for step in range(STEPS_BEFORE_SAVE):
        _step(model, optim, step, rank)
    saved = _door_state(model, optim)
    shardwrap.save_checkpoint(folder, model, optim)
    _step(model, optim, STEPS_BEFORE_SAVE, rank)
    after = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"saved": saved, "after": after}


def _door_load(rank: int, world_size: int, folder: str, save_to: str | None) -> dict:
    """Load into the FSDP2 door; the state loaded, and (at 2 ranks) the parameters after
    the next step."""
    model, optim = _door_model(world_size)
    shardwrap.load_checkpoint(folder, model, optim)
    state = _door_state(model, optim)
    if save_to is not None:
        shardwrap.save_checkpoint(save_to, model, optim)
    _step(model, optim, STEPS_BEFORE_SAVE, rank)
    after = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"state": state, "after": after}


def _fsdp1_load_and_save(rank: int, world_size: int, folder: str, save_to: str, optimizer: bool):
    model, optim = _fsdp1_model()
    shardwrap.load_checkpoint(folder, model, optim if optimizer else None)
    shardwrap.save_checkpoint(save_to, model, optim)
    return _fsdp1_params(model)


def _differences(expected: dict, found: dict) -> list[str]:
    if expected.keys() != found.keys():
        return [f"keys: {sorted(expected.keys() ^ found.keys())}"]
    return [name for name in expected if not torch.equal(expected[name], found[name])]


def test_door_checkpoints_reload_exactly_across_world_sizes_and_doors(tmp_path):
    door2, door3, fsdp1 = (str(tmp_path / name) for name in ("door2", "door3", "fsdp1"))
    first = run_ranks(_train_and_save, 2, door2)[0]
    saved, after = first["saved"], first["after"]
    assert len(saved) == 4 * len(after)  # each parameter, its step, exp_avg, exp_avg_sq
    for found in run_ranks(_door_load, 3, door2, door3):
        assert _differences(saved, found["state"]) == []
    saved_params = {name: saved[name] for name in after}
    for params in run_ranks(_fsdp1_load_and_save, 2, door3, fsdp1, True):
        assert _differences(saved_params, params) == []
    for found in run_ranks(_door_load, 2, fsdp1, None):
        assert _differences(saved, found["state"]) == []
        assert _differences(after, found["after"]) == []


def _dcp_run(rank: int, world_size: int, folder: str, ours: bool, load: bool, read: bool):
    """torch's or shardwrap's ``fully_shard``; train 2 steps and ``dcp.save`` the model's
    and optimizer's state dicts (``get_*_state_dict``), or train 1 step (so every state
    exists and differs) and ``dcp.load`` them back through ``set_*_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed import fsdp as torch_fsdp
    from torch.distributed.checkpoint import state_dict as dsd

    shard = shardwrap.fully_shard if ours else torch_fsdp.fully_shard
    torch.manual_seed(0)
    model = fc.TinyModel()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=fc.LR, weight_decay=0.1)
    for step in range(1 if load else STEPS_BEFORE_SAVE):
        _step(model, optim, step, rank)
    state = {
        "model": dsd.get_model_state_dict(model),
        "optim": dsd.get_optimizer_state_dict(model, optim),
    }
    if not load:
        dcp.save(state, checkpoint_id=folder)
        return _door_state(model, optim)
    if read:  # False: the negative control, nothing read
        dcp.load(state, checkpoint_id=folder)
    dsd.set_model_state_dict(model, state["model"])
    dsd.set_optimizer_state_dict(model, optim, state["optim"])
    return _door_state(model, optim)


@pytest.mark.parametrize("saved_by", ["torch", "shardwrap"])
def test_dcp_checkpoints_cross_between_torch_fsdp2_and_the_door(tmp_path, saved_by):
    """A DCP checkpoint of torch's FSDP2 at world 2 loads into shardwrap's door at world 3,
    and the reverse: every parameter and AdamW state equal, bit for bit. Negative control
    (run once, 2026-12-03): ``dcp.load`` left out fails it (the loader's own one-step
    state stays). ``dcp.load`` writes into the optimizer's own state tensors, so leaving
    out only ``set_optimizer_state_dict`` passes, under torch's FSDP2 as under the door."""
    folder = str(tmp_path / "dcp")
    ours_save = saved_by == "shardwrap"
    saved = run_ranks(_dcp_run, 2, folder, ours_save, False, True)[0]
    for loaded in run_ranks(_dcp_run, 3, folder, not ours_save, True, True):
        assert _differences(saved, loaded) == []
