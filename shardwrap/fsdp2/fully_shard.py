"""``fully_shard``: FSDP2's entry point, on shardwrap's engine.

[Note: bottom-up calls and the root]
FSDP2 code calls ``fully_shard`` bottom-up: each block, then the model. Each call makes
one unit of the module's parameters that no earlier call on a submodule took, so a
call never knows whether an ancestor's call will follow. Each call is therefore one root,
built as every door's is (``build.compose.build_root``, with ``ShardLayout.DIM0_CHUNKS``),
whose holder is the module itself; a later call on an ancestor adopts the nested roots'
units there (their runtimes' hooks removed, their names made relative to the new root,
the nested modules no roots any more) and starts the one runtime for all of them.
``reshard_after_forward=None`` (FSDP2's default) means False for the root and True for
every other unit, so each unit's setting is decided again whenever the root changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from ..assemble.casts import cast_inputs, cast_outputs
from ..assemble.compose import build_root
from ..assemble.root import ShardRoot, is_root
from ..assemble.wrap_options import WrapOptions
from ..comm.mesh import data_parallel_mesh
from ..layout.shard_layout import ShardLayout
from ..options import CommQuantization, ShardingStrategy
from .assign_load import register_assign_hooks
from .dp_mesh_dims import check_dp_mesh_dims
from .dtensor_views import install_dtensor_views
from .fully_shard_args import (
    UnitOptions,
    check_offload_mesh,
    parse_options,
    resolve_reshard_size,
)
from .group_hooks import register_group_hooks
from .meta_init import materialize_meta
from .module import as_fsdp_module
from .state import DoorUnit, set_state, state_of

# torch's defaults, shared as torch shares them (frozen records).
DEFAULT_MP_POLICY = MixedPrecisionPolicy()
DEFAULT_OFFLOAD_POLICY = OffloadPolicy()
# Resharding after forward is per unit (an override); a 2-D mesh is HSDP: the engine's
# hybrid sharding, sharded over the mesh's second dimension, replicated over its first.
STRATEGY = ShardingStrategy.FULL_SHARD
HSDP_STRATEGY = ShardingStrategy.HYBRID_SHARD


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh=None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn=None,
    mp_policy: MixedPrecisionPolicy = DEFAULT_MP_POLICY,
    offload_policy: OffloadPolicy = DEFAULT_OFFLOAD_POLICY,
    ignored_params=None,
    dp_mesh_dims=None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters not yet sharded by a call on a submodule into one
    unit, as ``torch.distributed.fsdp.fully_shard`` does; returns ``module``, its class
    now ``FSDP<Name>`` (an :class:`FSDPModule`). A list of modules makes one unit of all
    their parameters ([Note: a list as one unit]). Call it bottom-up, the root last
    ([Note: bottom-up calls and the root]). Parameters become ``DTensor`` s sharded
    ``Shard(0)`` on a 1-D ``mesh``, ``(Replicate(), Shard(0))`` on a 2-D one (HSDP)
    ([Note: DTensor shard views]). ``dp_mesh_dims`` names the data-parallel axes of a
    named ``mesh`` ([Note: dp_mesh_dims on the door]). What this release does not
    support is refused by name (``docs/migrating-from-fsdp2.md``).
    """
    members = list(module) if isinstance(module, (list, tuple)) else [module]
    for member in members:
        _check_module(member)
    options = parse_options(
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        master_dtype=_master_dtype(members),
    )
    # Every check before materialize_meta, the call's first change to the module (which
    # also makes new parameters, without their spmd_types annotations).
    own = [p for member in members for p in _own_params(member, options.ignored_params)]
    _check_not_taken(members, own)
    check_dp_mesh_dims(mesh, dp_mesh_dims, own)
    # The unit's module: the one given, or a container of the list (outside the tree).
    target = members[0] if len(members) == 1 else nn.ModuleList(members)
    device = next((p.device for p in target.parameters()), None)
    # A meta module's parameters get CPU storage (materialize_meta).
    device_type = "cpu" if device is None or device.type == "meta" else device.type
    mesh = data_parallel_mesh(mesh, device_type)
    check_offload_mesh(options, mesh.device_type)
    options = resolve_reshard_size(options, mesh.shape[-1])
    _check_nested_settings(target)
    materialize_meta(members)  # [Note: meta-device modules on the FSDP2 door]
    ignored = options.ignored_params | _left_out_below(target)
    # Alive until build_root adopts their units (the registry holds roots weakly).
    nested_roots = _release_nested(target)
    # The holder is the module users hold; a list's is its first member (in the tree,
    # where an ancestor's call finds it).
    root = build_root(target, _wrap_options(mesh, options, ignored), holder=members[0])
    del nested_roots
    _adopt_unit(root, target, members, mesh, options)
    for param in own:  # the objects as given: a module sharing one still holds it
        param.__dict__[_TAKEN] = root.units[0].name or type(members[0]).__name__
    for member in members:
        as_fsdp_module(member)
    return module


# [Note: a parameter shared by two calls]
# Two modules sharing one parameter (tied embeddings: ``out.weight = emb.weight``) sharded by
# two calls would give it two units: each call replaces its own module's attribute with a
# DTensor view of its unit, so the two copies train apart. FSDP2 refuses it at the root's
# first forward ("shared with a parameter already managed by another FSDP group"); the door
# refuses it at the second call, before changing anything. Each call marks the parameter
# objects it took (as given, before meta materialisation), and a later call that finds one
# among its own names the unit that holds it.
_TAKEN = "_shardwrap_fully_shard_unit"


def _check_not_taken(members: list[nn.Module], own: list[nn.Parameter]) -> None:
    taken = {id(p): p.__dict__[_TAKEN] for p in own if _TAKEN in p.__dict__}
    if not taken:
        return
    names = {id(p): f"{type(m).__name__}.{n}" for m in members for n, p in m.named_parameters()}
    first = next(iter(taken))
    raise ValueError(
        f"module: parameter {names.get(first, '?')!r} is shared with a parameter an earlier "
        f"fully_shard call already manages (unit {taken[first]!r}), as tied weights are; "
        "torch's FSDP2 refuses this too. Put the modules that share it in one call: "
        "fully_shard([module_a, module_b])"
    )


def _adopt_unit(root, target: nn.Module, members: list[nn.Module], mesh, options: UnitOptions):
    """Give the call's new unit its DTensor views, its door state on every member, the
    group and output-cast hooks, and make it the root until an ancestor's call adopts it."""
    unit = root.units[0]
    unit.follow_reshard_setting_without_grad()  # [Note: a forward without grad on the FSDP2 door]
    if unit.handle is not None:
        if unit.handle.grads.reduce_dtype == torch.float16:  # as FSDP2 divides fp16 sums
            unit.handle.grads.divide_around_reduction()
        install_dtensor_views(unit.handle, mesh)
        root.runtime.index_shard_views()  # the views the optimizer will hold
        for hook in register_assign_hooks(unit.handle, mesh):
            unit.add_hook_handle(hook)
    state = DoorUnit(unit, mesh, options.reshard_after_forward, tuple(members))
    for owner in {id(m): m for m in [target, *members]}.values():
        set_state(owner, state)
    if len(members) > 1:
        state.group = register_group_hooks(unit, members)
        _cast_member_inputs(unit, members, options)
    if options.output_dtype is not None:
        # After the unit's own forward hooks, as FSDP2 casts after its post-forward; on
        # each member of a list, as FSDP2 casts each one's outputs.
        for member in members:
            unit.add_hook_handle(cast_outputs(member, options.output_dtype))
    _start_root(root, members[0])


def _cast_member_inputs(unit, members: list[nn.Module], options: UnitOptions) -> None:
    """A list's unit module is a container outside the tree that never runs, so the input
    cast the engine hooks on a unit's module never fires for it; FSDP2 casts each member's
    floating inputs to ``param_dtype`` (after the group's gather hooks, registered first)."""
    policy = options.mixed_precision
    if policy is None or policy.param_dtype is None or not policy.cast_forward_inputs:
        return
    for member in members:
        unit.add_hook_handle(cast_inputs(member, policy.param_dtype))


def _wrap_options(mesh, options: UnitOptions, ignored: frozenset) -> WrapOptions:
    """The door's ``WrapOptions``: ZeRO-3 on ``mesh``'s group (HSDP on a 2-D mesh: shard
    groups along its second dimension, replicas along its first), FSDP2's dim-0 chunks, the
    call's mixed precision and CPU offload ([Note: FSDP2's mixed precision on the engine],
    [Note: FSDP2's CPU offload on the engine])."""
    return WrapOptions(
        sharding_strategy=STRATEGY if mesh.ndim == 1 else HSDP_STRATEGY,
        mixed_precision=options.mixed_precision,
        cpu_offload=options.cpu_offload,
        ignored_params=ignored,
        comm_quantization=_reshard_groups(options),
        device_mesh=mesh,
        layout=ShardLayout.DIM0_CHUNKS,
        fsdp1_units=False,
    )


def _reshard_groups(options: UnitOptions) -> CommQuantization | None:
    """hpZ for an int ``reshard_after_forward`` ([Note: FSDP2's reshard to a smaller world])."""
    if options.reshard_group_size is None:
        return None
    return CommQuantization(hpz_partition_size=options.reshard_group_size)


def _master_dtype(members: list[nn.Module]):
    """The dtype the call's floating parameters keep (torch >= 2.15's FSDP2 reduces in it
    when ``reduce_dtype`` is None); float32 when there is none."""
    floating = (p.dtype for m in members for p in m.parameters() if p.is_floating_point())
    return next(floating, torch.float32)


def _check_module(module: object) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
    if state_of(module) is not None:
        raise ValueError("module: fully_shard was already called on this module")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        # Its unit is gathered around the module's forward, and these containers have
        # none: their members would run on the shards.
        raise ValueError(
            f"module: an nn.{type(module).__name__} has no forward, so fully_shard cannot "
            "gather its unit; call fully_shard on the modules in it, or pass them as a list"
        )
    for name, param in module.named_parameters():
        if param.dim() == 0:
            raise ValueError(f"module: parameter {name!r} is a scalar; Shard(0) needs a dim")
    if any(is_root(m) and state_of(m) is None for m in module.modules()):
        raise ValueError(
            "module: it holds a ShardedModule (the FSDP1 door); use one door for a model"
        )


def _own_params(module: nn.Module, ignored: frozenset) -> list[nn.Parameter]:
    """The parameters this call shards: below ``module``, not below a module an earlier
    call sharded, not ignored."""
    taken = {
        id(p)
        for sub in module.modules()
        if sub is not module and state_of(sub) is not None
        for p in sub.parameters()
    }
    own = {id(p): p for p in module.parameters() if id(p) not in taken and p not in ignored}
    return list(own.values())


def _left_out_below(module: nn.Module) -> frozenset[nn.Parameter]:
    """The parameters below ``module`` that earlier calls on its submodules left out of
    their units (their ``ignored_params``): FSDP2's later calls leave them out too
    ([Note: FSDP2's ignored_params])."""
    nested = [state_of(sub) for sub in module.modules() if sub is not module]
    units = {id(s.unit): s.unit for s in nested if s is not None}.values()
    managed = {id(p) for unit in units if unit.handle for p in unit.handle.shard_params}
    return frozenset(
        param
        for sub in module.modules()
        if sub is not module and state_of(sub) is not None
        for param in sub.parameters()
        if id(param) not in managed
    )


def _nested_states(module: nn.Module) -> dict[int, DoorUnit]:
    """The records of the ``fully_shard`` roots below ``module``."""
    nested: dict[int, DoorUnit] = {}
    for sub in module.modules():
        state = state_of(sub)
        if sub is not module and state is not None and state.root is not None:
            nested[id(state)] = state
    return nested


def _check_nested_settings(module: nn.Module) -> None:
    """Refuse adopting a root whose root-only setting this call would drop."""
    roots = [state.root for state in _nested_states(module).values() if state.root]
    if any(root.runtime.manual.enabled for root in roots):  # the setting would be lost
        raise RuntimeError(
            "set_manual_backward_finalization must be called on the root FSDP module"
        )


def _release_nested(module: nn.Module) -> list[ShardRoot]:
    """The ``fully_shard`` roots below ``module``, their records cleared and their forward
    hooks removed (``build_root`` adopts their units; the new root's hook replaces theirs)."""
    nested = _nested_states(module)
    roots = [state.root for state in nested.values() if state.root is not None]
    for state in nested.values():
        state.root_hook.remove()
        state.root, state.root_hook = None, None
    return roots


def _start_root(root: ShardRoot, first: nn.Module) -> None:
    """Keep ``root`` on its module's record, decide each unit's resharding, and hook the
    forward of ``first`` (the module, or a list's first module) to begin the root's step."""
    for unit in root.units:
        state = state_of(unit.module)
        assert state is not None
        unit.set_reshard_after_forward(resharded_after_forward(state, unit is root.units[0]))
    root_state = state_of(first)
    assert root_state is not None
    root_state.root = root  # the record keeps the root alive (the registry holds it weakly)
    groups = [s.group for u in root.units if (s := state_of(u.module)) and s.group is not None]
    begin = root.begin_forward

    def begin_forward(*_: Any) -> None:
        for group in groups:  # [Note: a list as one unit]
            group.new_forward()
        begin()

    root_state.root_hook = first.register_forward_pre_hook(begin_forward, prepend=True)


def resharded_after_forward(state: DoorUnit, is_root: bool) -> bool:
    """A unit's ``reshard_after_forward``: as given, else FSDP2's default (root: False)."""
    if state.reshard_after_forward is not None:
        return state.reshard_after_forward
    return not is_root
