"""Which unit owns which parameter: collect a module tree's parameters, assign them.

Pure decisions over the module tree; no handle is built here (``assemble/units.py`` builds them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


class ParamSite:
    """One place a parameter is registered: ``module._parameters[attr]``.

    A tied parameter has several sites and one entry in the layout.
    """

    __slots__ = ("module", "attr")

    def __init__(self, module: nn.Module, attr: str) -> None:
        self.module = module
        self.attr = attr

    def set(self, param: nn.Parameter) -> None:
        self.module._parameters[self.attr] = param


@dataclass
class ParamRecord:
    """An original parameter, its name (first as ``named_parameters`` lists it) and sites."""

    param: nn.Parameter
    fqn: str
    sites: list[ParamSite] = field(default_factory=list)
    site_modules: list[nn.Module] = field(default_factory=list)


def collect_params(
    root: nn.Module,
    ignored_modules: set[nn.Module],
    excluded: set[int],
    *,
    children_first: bool = False,
) -> list[ParamRecord]:
    """Every managed parameter of ``root`` once, in ``named_parameters`` order, or with
    ``children_first`` in FSDP2's: modules after their children ([Note: FSDP2's parameter
    order]).

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
    if not children_first:
        return list(records.values())
    return _children_first(root, list(records.values()))


# [Note: FSDP2's parameter order]
# FSDP2 lays out a parameter group in the order of its modules after a depth-first walk
# that lists each module after its children, each module's own parameters in registration
# order; ``named_parameters`` lists a module's own first. The two differ wherever a module
# holds parameters and has children with parameters (a model's own scale beside its
# blocks). The FSDP2 door takes FSDP2's, so that a rank's shard holds its elements where
# FSDP2's does: the gradient sums' order depends on those positions ([Note: gloo's sum
# order] in comm/sum_order.py), and a user's communicator sees FSDP2's buffers.


def _children_first(root: nn.Module, records: list[ParamRecord]) -> list[ParamRecord]:
    """``records`` in FSDP2's order: by the first module, children before parents, that
    holds each (then by its place in that module's own parameters)."""
    place: dict[tuple[int, str], int] = {}
    visited: set[int] = set()

    def walk(module: nn.Module) -> None:
        visited.add(id(module))
        for child in module.children():
            if id(child) not in visited:
                walk(child)
        for attr in module._parameters:
            place.setdefault((id(module), attr), len(place))

    walk(root)
    return sorted(records, key=lambda r: min(place[(id(s.module), s.attr)] for s in r.sites))


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
