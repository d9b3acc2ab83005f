"""The composition root: ``build_root`` makes a ``ShardRoot`` from a module and options.

Every door (``ShardedModule``, DeepSpeed's ``initialize``, any later one) parses its
users' vocabulary into ``WrapOptions`` and calls this one function; what it builds, and in
which order, is in one place. See "The composition root" in docs/architecture.md.
"""

from __future__ import annotations

from torch import nn

from .. import hooks
from ..base.compiler import run_eagerly
from ..comm.collectives import CommLedger
from ..comm.groups import resolve_groups
from ..core.unit import Unit
from ..offload.host import host_staging_for
from ..runtime.schedule import Schedule
from ..runtime.step import StepRuntime
from . import casts as precision
from .comms import root_comms
from .fsdp_units import as_fsdp_unit
from .nesting import absorb_nested, check_not_wrapped
from .root import ShardRoot, add_root
from .sharding import check_offload_device, disk_store_for, shard_root
from .wrap_options import WrapOptions
from .zeropp_units import quantize_comms


def build_root(module: nn.Module, options: WrapOptions, *, holder: nn.Module) -> ShardRoot:
    """Shard ``module`` as ``options`` say and return its root, registered for ``holder``.

    ``holder`` is the object the door hands its users (the ``ShardedModule`` around
    ``module``); :func:`~shardwrap.assemble.root.root_of` finds the root from it, and the
    holder keeps it alive. In order: check the module, make the communicators and the
    disk store, adopt nested roots' units, plan and agree across ranks, build the new
    units, switch ZeRO++ on, start the step runtime, hook the units.
    """
    check_not_wrapped(module)
    check_offload_device(options.cpu_offload, module)
    strategy = options.sharding_strategy
    ledger = CommLedger()
    comms = root_comms(
        resolve_groups(strategy, options.process_group, options.device_mesh),
        strategy,
        ledger,
        options.param_persistence_threshold,
    )
    # DiskOffload: shards and Adam state in mapped files, named by the rank in the world.
    disk_store = disk_store_for(options.cpu_offload, comms.world.rank)
    absorbed = absorb_nested(module, ledger, policy=options.auto_wrap_policy)
    # CPUOffload: host shards, see [Note: host shards and staging]
    allocator = disk_store.allocate if disk_store else host_staging_for(options.cpu_offload)
    new_units, full_precision = shard_root(module, comms, absorbed, options, allocator)
    if disk_store is not None:
        disk_store.attach(u.handle for u in new_units)
    quantization = quantize_comms(options.comm_quantization, new_units, comms)
    units = new_units + list(absorbed)
    schedule = Schedule(
        forward_prefetch=options.forward_prefetch, backward_prefetch=options.backward_prefetch
    )
    runtime = StepRuntime(units, comms.world, schedule)
    root = ShardRoot(
        module=module,
        options=options,
        units=units,
        runtime=runtime,
        comms=comms,
        comm_ledger=ledger,
        disk_store=disk_store,
        comm_quantization=quantization,
        begin_forward=run_eagerly(runtime.begin_forward),
    )
    add_root(holder, root)
    _hook_units(root, new_units, full_precision)
    return root


def _hook_units(root: ShardRoot, new_units: list[Unit], full_precision: list[nn.Module]) -> None:
    """Make units FSDP instances to whoever looks, hook the new ones, install the casts."""
    for unit in root.units:  # [Note: units as FSDP instances]
        if unit.module is not root.module and root.options.fsdp1_units:
            as_fsdp_unit(unit.module)
    for unit in new_units:
        hooks.register(unit)
    full_ids = {id(m) for m in full_precision}
    precision.install_casts(new_units, root.module, root.options.mixed_precision, full_ids)
