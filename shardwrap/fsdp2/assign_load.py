"""``load_state_dict(..., assign=True)`` behind the FSDP2 door.

[Note: assigned parameters on the FSDP2 door]
``load_state_dict(sd, assign=True)`` does not copy into a module's parameters: it sets
each module attribute to a new ``nn.Parameter`` wrapping the state dict's tensor. FSDP2
clients do this to load sharded weights into a model sharded on the meta device
(accelerate's ``fsdp2_load_full_state_dict`` under ``cpu_ram_efficient_loading``:
``distribute_tensor`` of the full weights onto each parameter's mesh and placements,
then ``model.load_state_dict(sharded_sd, assign=True)``). The engine's shard views are
views of the unit's flat shard, so an assigned parameter is storage the engine never
reads: the next all-gather shows the old values, and the optimizer steps the new
object for nothing.

So every module that shows a unit's parameter gets a load-state-dict pre-hook, which
checks (before anything is assigned) that the shard view can take each tensor, and a
post-hook, which takes each assigned parameter's local tensor into its shard view (a
copy into the flat shard) and shows the view again: the module keeps the door's
parameter objects (those the runtime and an optimizer built earlier hold), with the
assigned values.
torch's FSDP2 instead keeps the assigned object and re-points the engine at its storage
(``FSDPParam.reset_sharded_param``); either way what trains is what was assigned. The
assigned tensor must be what FSDP2 itself accepts there: a ``Shard(0)`` ``DTensor`` of
the parameter's shape on a mesh of the unit's ranks in their order, this rank's local
chunk in the shard's dtype and device; anything else is refused naming the parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..flat_param import FlatParamHandle, ShardedState


def register_assign_hooks(handle: FlatParamHandle, mesh: DeviceMesh) -> list[Any]:
    """Per module showing ``handle``'s parameters, a load-state-dict pre-hook that checks
    what ``assign=True`` would set and a post-hook that takes it into the shard views
    ([Note: assigned parameters on the FSDP2 door]); the hooks' handles."""
    slots: dict[int, tuple[nn.Module, list[tuple[str, int]]]] = {}
    for module, attr, index in handle.site_slots:
        slots.setdefault(id(module), (module, []))[1].append((attr, index))
    hooks = []
    for module, module_slots in slots.values():
        frozen = tuple(module_slots)

        def check(module, state_dict, prefix, local_metadata, *_: Any, slots=frozen) -> None:
            if local_metadata.get("assign_to_params_buffers", False):
                check_assigned(handle, mesh, state_dict, prefix, slots)

        def adopt(module: nn.Module, incompatible_keys: Any, slots=frozen) -> None:
            adopt_assigned(handle, module, slots)

        hooks.append(module.register_load_state_dict_pre_hook(check))
        hooks.append(module.register_load_state_dict_post_hook(adopt))
    return hooks


def check_assigned(
    handle: FlatParamHandle,
    mesh: DeviceMesh,
    state_dict: dict[str, Any],
    prefix: str,
    slots: tuple[tuple[str, int], ...],
) -> None:
    """Refuse, before anything is assigned, a tensor the shard view cannot take."""
    for attr, index in slots:
        if prefix + attr not in state_dict:
            continue
        fqn = handle.layout.params[index].fqn
        if handle.state is not ShardedState.SHARDED:
            raise RuntimeError(
                f"load_state_dict(assign=True): parameter {fqn!r} would be assigned while "
                f"its unit is gathered (state {handle.state.value}); load between steps"
            )
        _assigned_local(fqn, state_dict[prefix + attr], handle.shard_params[index], mesh)


def adopt_assigned(
    handle: FlatParamHandle, module: nn.Module, slots: tuple[tuple[str, int], ...]
) -> None:
    """Copy each parameter ``load_state_dict(assign=True)`` set on ``module`` (checked by
    :func:`check_assigned`) into its shard view and show the view again."""
    for attr, index in slots:
        current = module._parameters.get(attr)
        view = handle.shard_params[index]
        if current is view or (
            handle.state is ShardedState.UNSHARDED and current is handle.full_params[index]
        ):
            continue
        assert isinstance(current, DTensor), "check_assigned let a plain tensor through"
        with torch.no_grad():
            view.to_local().copy_(current.to_local())
        module._parameters[attr] = view


def _assigned_local(fqn: str, assigned: Any, view: nn.Parameter, mesh: DeviceMesh):
    """The local tensor of ``assigned``, checked against what ``view`` is."""
    if not isinstance(assigned, DTensor):
        raise TypeError(
            f"load_state_dict(assign=True): parameter {fqn!r} must be assigned a DTensor "
            f"(Shard(0) on the module's mesh, as FSDP2 needs), got {type(assigned).__name__}; "
            "load a full tensor without assign=True"
        )
    expected = view.to_local()
    local = assigned.to_local()
    problems = []
    # The same ranks in the same order: then Shard(0)'s local chunk is this rank's piece.
    same_ranks = assigned.device_mesh.mesh.tolist() == mesh.mesh.tolist()
    if not same_ranks or tuple(assigned.placements) != (Shard(0),):
        problems.append(f"placements {assigned.placements} on {assigned.device_mesh}")
    if assigned.shape != view.shape or local.shape != expected.shape:
        problems.append(f"shape {tuple(assigned.shape)} (local {tuple(local.shape)})")
    if local.dtype != expected.dtype or local.device != expected.device:
        problems.append(f"{local.dtype} on {local.device}")
    if problems:
        raise ValueError(
            f"load_state_dict(assign=True): parameter {fqn!r} was assigned "
            f"{'; '.join(problems)}, expected a Shard(0) DTensor of shape {tuple(view.shape)} "
            f"(local {tuple(expected.shape)}), {expected.dtype} on {expected.device}, "
            f"on {mesh}"
        )
    return local
