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
