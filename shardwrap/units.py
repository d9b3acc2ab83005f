"""Turning a module tree into units: who owns which parameter, where each is registered."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .collectives import Communicator
from .flat_param import FlatParamHandle, ParamSite, ShardAllocator
from .hooks import Unit
from .layout import FlatLayout
from .mixed_precision import handle_precision
from .options import MixedPrecision, ShardingStrategy


@dataclass
class ParamRecord:
    """An original parameter, its name (first as ``named_parameters`` lists it) and sites."""

    param: nn.Parameter
    fqn: str
    sites: list[ParamSite] = field(default_factory=list)
    site_modules: list[nn.Module] = field(default_factory=list)


def collect_params(
    root: nn.Module, ignored_modules: set[nn.Module], excluded: set[int]
) -> list[ParamRecord]:
    """Every managed parameter of ``root`` once, in ``named_parameters`` order.

    Parameters registered only inside ignored modules, or whose ids are in ``excluded``
    (already sharded by a nested root), are left alone.
    """
    records: dict[int, ParamRecord] = {}
    seen_sites: set[tuple[int, str]] = set()
    ignored_ids = {id(m) for top in ignored_modules for m in top.modules()}
    for module_name, module in root.named_modules(remove_duplicate=False):
        if id(module) in ignored_ids:
            continue
        for attr, param in module._parameters.items():
            if param is None or id(param) in excluded:
                continue
            if (id(module), attr) in seen_sites:
                continue
            seen_sites.add((id(module), attr))
            fqn = f"{module_name}.{attr}" if module_name else attr
            record = records.setdefault(id(param), ParamRecord(param, fqn))
            record.sites.append(ParamSite(module, attr))
            record.site_modules.append(module)
    return list(records.values())


def assign_params(
    root: nn.Module, unit_modules: list[nn.Module], records: list[ParamRecord]
) -> dict[int, list[ParamRecord]]:
    """Give each parameter to the innermost unit whose subtree holds all of its sites.

    Returns ``{id(unit_module): records}``; ``root`` takes whatever no unit could.
    A parameter tied across two units goes to their closest common enclosing unit.
    """
    subtree = {id(m): {id(sub) for sub in m.modules()} for m in [*unit_modules, root]}
    depth_first = sorted(unit_modules, key=lambda m: len(subtree[id(m)]))
    owned: dict[int, list[ParamRecord]] = {id(m): [] for m in [*unit_modules, root]}
    for record in records:
        owner = root
        for candidate in depth_first:
            inside = subtree[id(candidate)]
            if all(id(m) in inside for m in record.site_modules):
                owner = candidate
                break
        owned[id(owner)].append(record)
    return owned


def build_unit(
    *,
    name: str,
    module: nn.Module,
    records: list[ParamRecord],
    shard_comm: Communicator,
    replicate_comm: Communicator | None,
    strategy: ShardingStrategy,
    mixed_precision: MixedPrecision | None = None,
    shard_allocator: ShardAllocator | None = None,
) -> Unit:
    """Flatten ``records`` into one handle (none if empty) and make the unit."""
    handle = None
    if records:
        layout = FlatLayout.build(
            [(r.fqn, tuple(r.param.shape), r.param.requires_grad) for r in records],
            shard_comm.size,
        )
        handle = FlatParamHandle(
            unit_name=name,
            layout=layout,
            params=[r.param for r in records],
            sites=[r.sites for r in records],
            shard_comm=shard_comm,
            replicate_comm=replicate_comm,
            strategy=strategy,
            precision=handle_precision(mixed_precision, records[0].param.dtype),
            shard_allocator=shard_allocator,
        )
    return Unit(name=name, module=module, handle=handle, strategy=strategy)
