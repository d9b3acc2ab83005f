"""``fully_shard``: FSDP2's entry point, on shardwrap's engine.

[Note: bottom-up calls and the root]
FSDP2 code calls ``fully_shard`` bottom-up: each block, then the model. Each call makes
one unit of the module's parameters that no earlier call on a submodule took (built by
the FSDP1 door's own ``build.setup.shard_root``, with the dim-0 chunk layout), so a
call never knows whether an ancestor's call will follow. Each call therefore starts a
runtime for its module as if it were the root; a later call on an ancestor adopts the
nested roots' units (their runtimes' hooks are removed, their names made relative to
the new root) and starts the one runtime for all of them. ``reshard_after_forward=None``
(FSDP2's default) means False for the root and True for every other unit, so each unit's
setting is decided again whenever the root changes.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from .. import hooks
from ..base.compiler import run_eagerly
from ..build.comms import root_comms
from ..build.setup import shard_root
from ..comm.collectives import CommLedger, Communicator
from ..comm.groups import resolve_groups
from ..comm.mesh import data_parallel_mesh
from ..core.unit import Unit
from ..layout.chunks import ChunkLayout
from ..options import BackwardPrefetch, ShardingStrategy
from ..runtime import registry
from ..runtime.schedule import Schedule
from ..runtime.step import StepRuntime
from .dtensor_views import install_dtensor_views
from .group_hooks import register_group_hooks
from .module import as_fsdp_module
from .options import NOT_YET, parse_options
from .state import DoorUnit, set_state, state_of

# torch's defaults, shared as torch shares them (frozen records).
DEFAULT_MP_POLICY = MixedPrecisionPolicy()
DEFAULT_OFFLOAD_POLICY = OffloadPolicy()
STRATEGY = ShardingStrategy.FULL_SHARD  # resharding after forward is per unit (override)
# Full views start at multiples of 64 elements: 64-byte aligned for every dtype, as the CPU
# allocator aligns a tensor of its own ([Note: aligned full views] in layout/chunks.py).
ALIGN_NUMEL = 64


def _align(num_shards: int) -> int:
    # One shard computes on the shard itself, which stays end to end.
    return ALIGN_NUMEL if num_shards > 1 else 1


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
    ``Shard(0)`` on ``mesh`` ([Note: DTensor shard views]). What this release does not
    support is refused by name (``docs/migrating-from-fsdp2.md``).
    """
    options = parse_options(
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
    )
    members = list(module) if isinstance(module, (list, tuple)) else [module]
    for member in members:
        _check_module(member)
    # The unit's module: the one given, or a container of the list (outside the tree).
    target = members[0] if len(members) == 1 else nn.ModuleList(members)
    device = next((p.device for p in target.parameters()), None)
    mesh = data_parallel_mesh(mesh, device.type if device is not None else "cpu")
    comms = root_comms(resolve_groups(STRATEGY, None, mesh), STRATEGY, CommLedger(), 0)
    adopted = _adopt_nested(target)
    new_units, _ = shard_root(
        target,
        comms,
        adopted,
        policy=None,
        ignored=set(),
        param_init_fn=None,
        device_id=None,
        sync_module_states=False,
        strategy=STRATEGY,
        mixed_precision=None,
        shard_allocator=None,
        threshold=0,
        options="fully_shard (FSDP2 door), dim-0 chunks",
        make_layout=functools.partial(ChunkLayout.build, align_numel=_align(comms.shard.size)),
    )
    unit = new_units[0]
    if unit.handle is not None:
        install_dtensor_views(unit.handle, mesh)
    state = DoorUnit(unit, mesh, options.reshard_after_forward, tuple(members))
    for owner in {id(m): m for m in [target, *members]}.values():
        set_state(owner, state)
    if len(members) == 1:
        hooks.register(unit)
    else:
        register_group_hooks(unit, members)
    _start_root(target, members[0], [unit, *adopted], comms.world)
    for member in members:
        as_fsdp_module(member)
    return module


def _check_module(module: object) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
    if state_of(module) is not None:
        raise ValueError("module: fully_shard was already called on this module")
    for name, param in module.named_parameters():
        if param.is_meta:
            raise ValueError(
                f"module: parameter {name!r} is on the meta device; meta-device "
                f"initialisation {NOT_YET}; materialise the module before fully_shard"
            )
        if param.dim() == 0:
            raise ValueError(f"module: parameter {name!r} is a scalar; Shard(0) needs a dim")
    if any(registry.is_root(m) and state_of(m) is None for m in module.modules()):
        raise ValueError(
            "module: it holds a ShardedModule (the FSDP1 door); use one door for a model"
        )


def _adopt_nested(module: nn.Module) -> list[Unit]:
    """Take over the units of the ``fully_shard`` roots below ``module``."""
    adopted: list[Unit] = []
    for path, sub in module.named_modules():
        state = state_of(sub)
        if sub is module or state is None or state.runtime is None:
            continue
        state.runtime.remove_hooks()
        state.root_hook.remove()
        registry.remove_root(state.unit.module)
        for unit in state.runtime.units:
            unit.name = f"{path}.{unit.name}" if unit.name else path
            if unit.handle is not None:
                unit.handle.rename(path)
            adopted.append(unit)
        state.runtime, state.root_hook = None, None
    return adopted


def _start_root(
    module: nn.Module, first: nn.Module, units: list[Unit], world: Communicator
) -> None:
    """Make ``module`` the root of ``units``: decide each unit's resharding, start the
    runtime, and hook the forward of ``first`` (``module``, or a list's first module)."""
    for unit in units:
        state = state_of(unit.module)
        assert state is not None
        unit.reshard_after_forward_override = resharded_after_forward(state, unit is units[0])
    schedule = Schedule(forward_prefetch=False, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    runtime = StepRuntime(units, world, schedule)
    registry.add_root(module, module, runtime)
    begin = run_eagerly(runtime.begin_forward)
    root_state = state_of(module)
    assert root_state is not None
    root_state.runtime = runtime
    root_state.root_hook = first.register_forward_pre_hook(lambda *_: begin(), prepend=True)


def resharded_after_forward(state: DoorUnit, is_root: bool) -> bool:
    """A unit's ``reshard_after_forward``: as given, else FSDP2's default (root: False)."""
    if state.reshard_after_forward is not None:
        return state.reshard_after_forward
    return not is_root
