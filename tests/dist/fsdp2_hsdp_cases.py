"""Rank workers for tests/dist/test_fsdp2_hsdp.py: the FSDP2 script of fsdp2_cases on HSDP.

The model, data and AdamW are tests/dist/fsdp2_cases.py's; the mesh is 2-D,
``(replicas, shards)`` named ``("dp_replicate", "dp_shard")``, ``fully_shard`` on each
block, then the root. Besides what ``fc.Record`` shows (losses, gradient norms, every
parameter's ``full_tensor()``, local shapes, placements, ``model.state_dict()``), each step
records every parameter's local shard and its gradient's local shard and placements, the
``.grad`` of every parameter after each microbatch that skipped the replica all-reduce,
and how often the all-reduce hook ran. Each script runs once with torch's
``fully_shard`` and once with shardwrap's (or a negative control's) in one call on the
ranks, and the records are compared there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardwrap
from shardwrap.fsdp2.state import state_of
from tests.dist import fsdp2_cases as fc

REPLICAS = 2
MESH_DIMS = ("dp_replicate", "dp_shard")
# Each microbatch's (FSDPModule method, flag), step by step in turn (HsdpScript.accumulate).
SCHEDULES = (
    (("set_requires_all_reduce", False), ("set_requires_all_reduce", True)),
    (
        ("set_requires_all_reduce", False),
        ("set_requires_gradient_sync", False),
        ("set_requires_gradient_sync", True),
    ),
)


@dataclass(frozen=True)
class HsdpScript:
    """How the client script trains on the 2-D mesh.

    ``accumulate``: False, one microbatch a step; True, microbatches by :data:`SCHEDULES`
    in turn: two, the first under ``set_requires_all_reduce(False)`` (reduce-scattered,
    not all-reduced), the second under True; then three: ``set_requires_all_reduce(False)``,
    ``set_requires_gradient_sync(False)`` (not even reduce-scattered),
    ``set_requires_gradient_sync(True)`` (which under FSDP2 sets the all-reduce back on).
    ``hook``: every FSDPModule's ``set_all_reduce_hook(scaled_hook)``. ``one_d``: the 2-D
    mesh's ``"dp_shard"`` dimension as a 1-D mesh (two 2-rank FSDP worlds with their own
    data, no replicas). ``bf16``: every call's ``MixedPrecisionPolicy(bf16, bf16)``
    (computing and reducing in bf16 on every torch release; fp32 parameters).
    """

    accumulate: bool = False
    hook: bool = False
    one_d: bool = False
    bf16: bool = False


@dataclass
class HsdpRecord(fc.Record):
    """``fc.Record`` and what only HSDP shows (see the module docstring)."""

    local: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # before clipping
    grad_placements: list[dict[str, str]] = field(default_factory=list)
    skipped_grads: list[dict[str, bool]] = field(default_factory=list)  # .grad is not None
    hook_calls: list[int] = field(default_factory=list)  # per step, all units together


def scaled_hook(calls: list[int], reduced: torch.Tensor) -> None:
    """The hook: count the call, then change the gradient in place by exactly rounded
    elementwise ops (so any arrangement of the elements gives the same bits)."""
    calls[0] += 1
    reduced.mul_(0.75).add_(1e-4)


def mesh_for(world_size: int, script: HsdpScript):
    mesh = init_device_mesh("cpu", (REPLICAS, world_size // REPLICAS), mesh_dim_names=MESH_DIMS)
    return mesh["dp_shard"] if script.one_d else mesh


def run_script(
    shard: Callable[..., nn.Module], rank: int, world_size: int, script: HsdpScript
) -> HsdpRecord:
    """The FSDP2 client script on HSDP, with ``shard`` as its ``fully_shard``."""
    torch.manual_seed(0)
    model = fc.TinyModel()
    mesh = mesh_for(world_size, script)
    bf16 = torch_fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)
    kw = {"mp_policy": bf16} if script.bf16 else {}
    for block in model.blocks:
        shard(block, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    calls = [0]
    if script.hook:
        for module in model.modules():
            if isinstance(module, (torch_fsdp.FSDPModule, shardwrap.FSDPModule)):
                module.set_all_reduce_hook(functools.partial(scaled_hook, calls))
    optim = torch.optim.AdamW(model.parameters(), lr=fc.LR, weight_decay=0.1)
    record = HsdpRecord()
    for step in range(fc.NUM_STEPS):
        calls[0] = 0
        schedule = SCHEDULES[step % len(SCHEDULES)] if script.accumulate else ((None, None),)
        for micro, (method, flag) in enumerate(schedule):
            last = micro == len(schedule) - 1
            if method is not None:
                getattr(model, method)(flag)
            idx, target = fc.batch(10 * step + micro, rank)
            loss = F.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1))
            loss.backward()
            if not last:
                params = model.named_parameters()
                record.skipped_grads.append({n: p.grad is not None for n, p in params})
        record.hook_calls.append(calls[0])
        _read_grads(model, record)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), fc.CLIP_NORM)
        record.grad_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        optim.step()
        optim.zero_grad()
        record.losses.append(float(loss.detach()))
        fc._read(model, record)
        record.local.append({n: p.to_local().clone() for n, p in model.named_parameters()})
    return record


def _read_grads(model: nn.Module, record: HsdpRecord) -> None:
    grads = {n: p.grad for n, p in model.named_parameters()}
    record.grads.append({n: g.to_local().clone() for n, g in grads.items()})
    record.grad_placements.append(
        {n: f"{g.placements} {g.device_mesh.mesh_dim_names}" for n, g in grads.items()}
    )


def no_all_reduce_fully_shard(module: nn.Module, **kwargs) -> nn.Module:
    """Negative control: shardwrap's door with each unit's replica all-reduce removed
    (every replica keeps its own gradients, averaged over its shard group only)."""
    shardwrap.fully_shard(module, **kwargs)
    state_of(module).unit.handle.grads.replicate_comm = None
    return module


def skip_ignored_fully_shard(module: nn.Module, **kwargs) -> nn.Module:
    """Negative control: ``set_requires_all_reduce`` a no-op (every backward all-reduces)."""
    shardwrap.fully_shard(module, **kwargs)
    module.set_requires_all_reduce = lambda *args, **kw: None  # on the instance
    return module


def hook_before_division_fully_shard(module: nn.Module, **kwargs) -> nn.Module:
    """Negative control: the hook run on the undivided sum (as under force-sum)."""
    shardwrap.fully_shard(module, **kwargs)
    state_of(module).unit.handle.grads.replicas.hook_sees_sum = True
    return module


def fp32_compute_fully_shard(module: nn.Module, *, mp_policy=None, **kwargs) -> nn.Module:
    """Negative control of the bf16 case: shardwrap's door with ``mp_policy`` dropped."""
    return shardwrap.fully_shard(module, **kwargs)


CONTROLS = {
    "no_all_reduce": no_all_reduce_fully_shard,
    "fp32_compute": fp32_compute_fully_shard,
    "skip_ignored": skip_ignored_fully_shard,
    "hook_before_division": hook_before_division_fully_shard,
}


def differences(reference: HsdpRecord, ours: HsdpRecord) -> list[str]:
    """``fc.differences`` (bit for bit) and the HSDP views, exactly."""
    found = fc.differences(reference, ours)
    for view in ("local", "grads", "grad_placements", "skipped_grads"):
        for step, (a, b) in enumerate(zip(getattr(reference, view), getattr(ours, view))):
            for name in a.keys() | b.keys():
                x, y = a.get(name), b.get(name)
                same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                if not same:
                    found.append(f"step {step}: {view}[{name!r}] {_show(x)} != {_show(y)}")
    if reference.hook_calls != ours.hook_calls:
        found.append(f"hook calls {reference.hook_calls} != {ours.hook_calls}")
    return found


def _show(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} sum {value.double().sum().item():.9g}"
    return repr(value)


def compare_all(
    rank: int, world_size: int, cases: list[tuple[HsdpScript, tuple[str | None, ...]]]
) -> list[list[list[str]]]:
    """For each ``(script, controls)``: torch's run once, then shardwrap's door (control
    None) or each negative control's; their differences from torch's, in that order."""
    results = []
    for script, controls in cases:
        reference = run_script(torch_fsdp.fully_shard, rank, world_size, script)
        found = []
        for control in controls:
            dist.barrier()
            shard = shardwrap.fully_shard if control is None else CONTROLS[control]
            found.append(differences(reference, run_script(shard, rank, world_size, script)))
        results.append(found)
    return results


def _error(call: Callable[[], object]) -> str:
    try:
        call()
    except (ValueError, TypeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def refusals(rank: int, world_size: int) -> dict[str, str]:
    """What the door refuses on meshes and HSDP knobs, each as ``"<error type>: <text>"``;
    and, as their negative controls, the same calls where they are supported."""
    found = {}
    cube = init_device_mesh("cpu", (1, REPLICAS, world_size // REPLICAS))
    found["3-D mesh"] = _error(lambda: shardwrap.fully_shard(nn.Linear(4, 4), mesh=cube))
    mesh = init_device_mesh("cpu", (REPLICAS, world_size // REPLICAS), mesh_dim_names=MESH_DIMS)
    hsdp = shardwrap.fully_shard(nn.Linear(4, 4), mesh=mesh)
    found["hook stream under HSDP"] = _error(lambda: hsdp.set_all_reduce_hook(print, stream=1))
    found["hook under HSDP"] = _error(lambda: hsdp.set_all_reduce_hook(print))
    found["skip under HSDP"] = _error(lambda: hsdp.set_requires_all_reduce(False))
    one_shard = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=MESH_DIMS)
    unsharded = shardwrap.fully_shard(nn.Linear(4, 4), mesh=one_shard)
    found["skip with one shard"] = _error(lambda: unsharded.set_requires_all_reduce(False))
    found["sync off with one shard"] = _error(lambda: unsharded.set_requires_gradient_sync(False))
    policy = torch_fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)
    bf16 = shardwrap.fully_shard(nn.Linear(4, 4), mesh=mesh, mp_policy=policy)
    found["hook, bf16 reduction"] = _error(lambda: bf16.set_all_reduce_hook(print))
    policy = torch_fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    fp32_reduce = shardwrap.fully_shard(nn.Linear(4, 4), mesh=mesh, mp_policy=policy)
    found["hook, fp32 reduction"] = _error(lambda: fp32_reduce.set_all_reduce_hook(print))
    return found


def _whole_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state as a whole tensor (``full_tensor()``), by name."""
    found = {}
    for name, param in model.named_parameters():
        found[name] = param.full_tensor().detach().clone()
        for key, value in optim.state[param].items():
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            found[f"{name}/{key}"] = whole.detach().clone()
    return found


def dcp_run(rank: int, world_size: int, folder: str, ours: bool, hsdp: bool, load: bool):
    """torch's or shardwrap's ``fully_shard`` on the (2, 2) mesh (``hsdp``) or a 1-D one;
    train 2 steps and ``dcp.save`` ``get_model_state_dict`` / ``get_optimizer_state_dict``,
    or (``load``) train 1 step, ``dcp.load`` and ``set_*_state_dict``; the whole state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    shard = shardwrap.fully_shard if ours else torch_fsdp.fully_shard
    torch.manual_seed(0)
    model = fc.TinyModel()
    mesh = mesh_for(world_size, HsdpScript()) if hsdp else init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=fc.LR, weight_decay=0.1)
    for step in range(1 if load else 2):
        idx, target = fc.batch(step, rank)
        F.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1)).backward()
        optim.step()
        optim.zero_grad()
    state = {
        "model": dsd.get_model_state_dict(model),
        "optim": dsd.get_optimizer_state_dict(model, optim),
    }
    if load:
        dcp.load(state, checkpoint_id=folder)
        dsd.set_model_state_dict(model, state["model"])
        dsd.set_optimizer_state_dict(model, optim, state["optim"])
    else:
        dcp.save(state, checkpoint_id=folder)
    return _whole_state(model, optim)


def _door_model(mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fc.TinyModel()
    for block in model.blocks:
        shardwrap.fully_shard(block, mesh=mesh)
    shardwrap.fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=fc.LR, weight_decay=0.1)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for step in steps:
        idx, target = fc.batch(step, rank)
        F.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1)).backward()
        optim.step()
        optim.zero_grad()


def shardwrap_checkpoint_run(rank: int, world_size: int, folder: str) -> dict:
    """The door on the (2, 2) mesh: 2 steps, ``shardwrap.save_checkpoint``; then the door
    on a 1-D mesh of 4 and on the (2, 2) mesh, each trained 1 step on other data and
    loaded (``load_checkpoint``): the whole state of each."""
    model, optim = _door_model(mesh_for(world_size, HsdpScript()))
    _train(model, optim, range(2), rank)
    found = {"saved": _whole_state(model, optim)}
    shardwrap.save_checkpoint(folder, model, optim)
    meshes = {
        "1-D": init_device_mesh("cpu", (world_size,)),
        "HSDP": mesh_for(world_size, HsdpScript()),
    }
    for name, mesh in meshes.items():
        model, optim = _door_model(mesh)
        _train(model, optim, range(5, 6), rank)
        shardwrap.load_checkpoint(folder, model, optim)
        found[name] = _whole_state(model, optim)
    return found
