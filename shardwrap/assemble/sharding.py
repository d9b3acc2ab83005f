"""Building a ``ShardedModule``'s units and checking its arguments (no process group state)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..base.validate import check_int
from ..comm import collectives
from ..comm.collectives import Communicator
from ..core.storage import ShardAllocator
from ..core.unit import Unit
from ..layout.flat import FlatLayout
from ..layout.partition import assign_params, collect_params
from ..layout.persistence import is_persistent
from ..layout.shard_layout import LayoutBuilder
from ..offload.disk import DiskStore
from ..options import CPUOffload, DiskOffload, MixedPrecision, ShardingStrategy
from ..policies import select_units
from . import casts as precision
from . import optimizer_guard
from .agreement import check_plan, plan_entries
from .comms import RootComms, UnitComms
from .deferred_init import UnitMaterializer, has_meta
from .units import build_unit
from .unused_args import note_param_init_fn_unused
from .wrap_options import WrapOptions


def build_units(
    root: nn.Module,
    unit_modules: list[nn.Module],
    owned: dict[int, list],
    *,
    materializer: UnitMaterializer | None,
    shard_comm: Communicator,
    replicate_comm: Communicator | None,
    strategy: ShardingStrategy,
    mixed_precision: MixedPrecision | None,
    full_precision: list[nn.Module],
    shard_allocator=None,
    persistent: tuple[UnitComms | None, int] = (None, 0),
    make_layout: LayoutBuilder = FlatLayout.build,
) -> list[Unit]:
    """One unit per module, root first; materialise each right before it is sharded.

    ``owned`` is consumed, so each unit's full parameters die once its shard is built
    ([Note: unit-by-unit materialisation] in ``assemble/deferred_init.py``).
    """
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    units = []
    for module in [root, *unit_modules]:
        records = owned.pop(id(module))
        if materializer is not None:
            materializer.prepare(module, records, root)
        optimizer_guard.retire([r.param for r in records])
        comms = UnitComms(shard_comm, replicate_comm)
        kept_whole, threshold = persistent
        if kept_whole is not None and is_persistent(
            sum(r.param.numel() for r in records), threshold
        ):
            comms = kept_whole
        units.append(
            build_unit(
                name=names[id(module)],
                module=module,
                records=records,
                shard_comm=comms.shard,
                replicate_comm=comms.replicate,
                strategy=strategy,
                mixed_precision=None if module in full_precision else mixed_precision,
                shard_allocator=shard_allocator,
                make_layout=make_layout,
            )
        )
        del records
    return units


def full_precision_units(
    module: nn.Module, policy: MixedPrecision | None, ignored: set[nn.Module]
) -> list[nn.Module]:
    ignored_ids = {id(m) for top in ignored for m in top.modules()}
    return [m for m in precision.excluded_modules(module, policy) if id(m) not in ignored_ids]


def check_offload_device(cpu_offload: CPUOffload | DiskOffload | None, module: nn.Module) -> None:
    """``DiskOffload`` keeps a CPU model's shards in files; an accelerator model is refused."""
    if isinstance(cpu_offload, DiskOffload) and on_accelerator(module):
        raise ValueError("cpu_offload: DiskOffload of accelerator models is not supported")


def resolve_ignored(
    ignored_modules: Iterable[nn.Module] | None, ignored_states: Iterable[Any] | None, root
) -> set[nn.Module]:
    ignored: set[nn.Module] = set()
    for source, values in (
        ("ignored_modules", ignored_modules),
        ("ignored_states", ignored_states),
    ):
        for item in values or ():
            if not isinstance(item, nn.Module):
                raise TypeError(f"{source}: expected nn.Module entries, got {type(item).__name__}")
            if item is root:
                raise ValueError(f"{source}: cannot ignore the root module itself")
            ignored.add(item)
    return ignored


def check_one_device(records: list) -> None:
    devices: dict[torch.device, str] = {}
    for record in records:
        devices.setdefault(record.param.device, record.fqn)
    if len(devices) > 1:
        found = ", ".join(f"{fqn} on {device}" for device, fqn in devices.items())
        raise ValueError(
            f"module: parameters on mixed devices ({found}); move the module to one device "
            "or pass device_id"
        )


def check_bucket_bytes(num_bytes: object) -> int:
    """A bucket budget in bytes (0 turns bucketing off)."""
    return check_int("num_bytes", num_bytes, minimum=0, meaning="0 turns bucketing off")


def on_accelerator(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters lives on an accelerator (not CPU, not meta)."""
    return any(p.device.type not in ("cpu", "meta") for p in module.parameters())


def shard_root(
    module: nn.Module,
    comms: RootComms,
    absorbed: list[Unit],
    options: WrapOptions,
    shard_allocator: ShardAllocator | None,
) -> tuple[list[Unit], list[nn.Module]]:
    """Shard ``module`` into units (``absorbed`` ones aside): the new units, and the
    modules that mixed precision leaves in full precision. ``shard_allocator``: where
    shards live (``None``: on the device). Before any collective, every rank checks that
    all plan the same units and options ([Note: rank agreement]).
    """
    deferred = has_meta(module)
    if options.param_init_fn is not None and not deferred:
        note_param_init_fn_unused()  # [Note: FSDP1 arguments not acted on]
    device_id = options.device_id
    device = torch.device("cpu") if device_id is None else torch.device(device_id)
    if device_id is not None and not deferred:
        module.to(device)
    unit_modules, full_precision, owned = _plan_units(module, absorbed, options, deferred)
    strategy, sync_module_states = options.sharding_strategy, options.sync_module_states
    entries = plan_entries(
        module, unit_modules, owned, strategy, options.mixed_precision, full_precision
    )
    check_plan(comms, strategy, entries, options.agreed())
    materializer = UnitMaterializer(
        module,
        unit_modules,
        options.ignored,
        options.param_init_fn,
        device,
        sync_comm=comms.world if sync_module_states else None,
    )
    new_units = build_units(
        module,
        unit_modules,
        owned,
        materializer=materializer if deferred or sync_module_states else None,
        shard_comm=comms.shard,
        replicate_comm=comms.replicate,
        strategy=strategy,
        mixed_precision=options.mixed_precision,
        full_precision=full_precision,
        shard_allocator=shard_allocator,
        persistent=(comms.persistent, options.param_persistence_threshold),
        make_layout=options.layout.builder(comms.shard.size),
    )
    if deferred or sync_module_states:
        materializer.finish(module, options.ignored)
    return new_units, full_precision


def _plan_units(
    module: nn.Module, absorbed: list[Unit], options: WrapOptions, deferred: bool
) -> tuple[list[nn.Module], list[nn.Module], dict[int, list]]:
    """The unit modules below ``module``, those kept in full precision, and the parameter
    records each unit will own. Only the owned records survive the call: full tensors
    then die unit by unit ([Note: unit-by-unit materialisation])."""
    ignored, mixed_precision = options.ignored, options.mixed_precision
    excluded = {id(p) for u in absorbed if u.handle for p in u.handle.shard_params}
    excluded |= {id(p) for p in options.ignored_params}
    absorbed_modules = {u.module for u in absorbed}
    unit_modules = select_units(module, options.auto_wrap_policy, ignored | absorbed_modules)
    full_precision = full_precision_units(module, mixed_precision, ignored)
    unit_modules += [m for m in full_precision if m not in unit_modules]
    precision.cast_buffers(module, mixed_precision, keep=full_precision)
    order = options.layout.children_first
    records = collect_params(module, ignored, excluded, children_first=order)
    if not deferred:
        check_one_device(records)
    uses_dtensor = any(isinstance(r.param, DTensor) for r in records)
    if (deferred or options.sync_module_states) and uses_dtensor:
        raise ValueError(
            "sync_module_states / meta-device initialisation: not supported for DTensor "
            "(tensor-parallel) parameters; initialise them before parallelize_module"
        )
    return unit_modules, full_precision, assign_params(module, unit_modules, records)


def disk_store_for(cpu_offload: object, group_rank: int) -> DiskStore | None:
    """``DiskOffload``'s store of shards and Adam state in mapped files, else None.

    Files are named by the global rank (``group_rank``, the model's own group's, without a
    default group): a pipeline stage's group holds only its data-parallel ranks.
    """
    if not isinstance(cpu_offload, DiskOffload):
        return None
    rank = collectives.world_rank() if collectives.is_initialized() else group_rank
    return DiskStore(cpu_offload.path, rank, cpu_offload.sub_group_size)
