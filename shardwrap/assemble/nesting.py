"""Wrapping inside a wrap: refuse a module wrapped twice, adopt nested wrappers' units.

A ``ShardedModule`` built around a model that already holds ``ShardedModule`` children
(FSDP1's nested wrapping style) takes those children's units over as its own: the
children disappear from the module tree, and their units' names become relative to the
new root. A module that some other ``ShardedModule`` already manages cannot be wrapped
again. Roots are found through the registry of roots (``root.is_root``), not by class: every
unit's module is an instance of ``ShardedModule`` too ([Note: units as FSDP instances]).
"""

from __future__ import annotations

from torch import nn

from ..comm.ledger import CommLedger
from ..core.unit import Unit
from ..policies import PolicyCallable
from ..runtime import registry
from .root import find_root, forget_root, is_root


def check_not_wrapped(module: object) -> None:
    """Raise unless ``module`` is a module no ``ShardedModule`` manages yet (nested ones
    inside it are fine: they are adopted)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
    if is_root(module):
        raise ValueError("module: this module is already a ShardedModule (wrapped twice)")
    for name, sub in module.named_modules():
        if registry.is_managed(sub) and not _is_nested_root(module, sub):
            where = f"submodule {name!r}" if name else "the module"
            raise ValueError(
                f"module: {where} is already managed by a ShardedModule (wrapped twice)"
            )


def _is_nested_root(root: nn.Module, sub: nn.Module) -> bool:
    """Whether ``sub`` belongs to a ``ShardedModule`` sitting inside ``root`` (absorbable)."""
    roots = (find_root(m) for m in root.modules())
    return any(r is not None and any(u.module is sub for u in r.units) for r in roots)


def absorb_nested(
    module: nn.Module, ledger: CommLedger, *, policy: PolicyCallable | None = None
) -> list[Unit]:
    """Replace nested ``ShardedModule`` wrappers by their modules and adopt their units.

    The adopted units' names and parameter names become relative to ``module``; their
    roots' ledgers record into ``ledger`` from now on ([Note: adopted ledgers]). With an
    auto-wrap ``policy`` nested wrappers are refused, as FSDP1 refuses them: the policy
    would decide again what they already decided.
    """
    adopted: list[Unit] = []
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            nested = find_root(child)
            if nested is not None:
                if policy is not None:
                    path = f"{parent_name}.{child_name}" if parent_name else child_name
                    raise ValueError(
                        f"auto_wrap_policy: submodule {path!r} is already a "
                        "FullyShardedDataParallel instance; wrap nested modules either by "
                        "hand or with a policy, not both"
                    )
                path = f"{parent_name}.{child_name}" if parent_name else child_name
                units = nested.units
                nested.runtime.remove_hooks()
                ledger.adopt(nested.comm_ledger)
                for unit in units:
                    unit.rename(path)
                adopted.extend(units)
                if any(c is nested.module for c in child.children()):  # a wrapper: unwrap
                    parent._modules[child_name] = nested.module
                else:  # the holder is the module, or a list unit's first one: it stays
                    forget_root(child)
    return adopted
