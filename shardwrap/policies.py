"""Auto-wrap policies with ``torch.distributed.fsdp.wrap``'s call signatures.

A policy is called as ``policy(module=..., recurse=..., nonwrapped_numel=...)``: with
``recurse=True`` it answers "look inside this module for units", with ``recurse=False``
"make this module a unit", given the parameters not already taken by units below it.
So ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)`` written for
torch works unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

PolicyCallable = Callable[..., bool]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Make every module a unit."""
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true."""
    if recurse:
        return True
    return bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: Iterable[type[nn.Module]],
) -> bool:
    """Wrap instances of the given layer classes (a transformer's blocks)."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once at least ``min_num_params`` of its parameters are not in a unit."""
    leaves = tuple(force_leaf_modules or (nn.MultiheadAttention,))
    excluded = tuple(exclude_wrap_modules or (nn.ModuleList, nn.ModuleDict))
    if recurse:
        return not isinstance(module, leaves)
    return nonwrapped_numel >= min_num_params and not isinstance(module, excluded)


class ModuleWrapPolicy:
    """Wrap every instance of the given module classes."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        classes = tuple(module_classes)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(f"ModuleWrapPolicy: {cls!r} is not an nn.Module subclass")
        self.module_classes = classes

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True
        return isinstance(module, self.module_classes)


class CustomPolicy:
    """Wrap the modules for which ``lambda_fn(module)`` returns true (or an empty dict)."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(f"CustomPolicy: lambda_fn must be callable, got {type(lambda_fn)}")
        self.lambda_fn = lambda_fn

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True
        answer = self.lambda_fn(module)
        if isinstance(answer, dict):
            if answer:
                raise ValueError(
                    f"CustomPolicy: per-unit overrides {sorted(answer)} for "
                    f"{type(module).__name__} are not supported; return True or False"
                )
            return True
        return bool(answer)


def as_policy(policy: object) -> PolicyCallable | None:
    """Validate ``auto_wrap_policy``; torch's policy objects are accepted too."""
    if policy is None:
        return None
    torch_classes = getattr(policy, "_module_classes", None)
    if torch_classes is not None and not isinstance(policy, ModuleWrapPolicy):
        return ModuleWrapPolicy(torch_classes)  # torch.distributed.fsdp.wrap.ModuleWrapPolicy
    torch_lambda = getattr(policy, "_lambda_fn", None)
    if torch_lambda is not None and not isinstance(policy, CustomPolicy):
        return CustomPolicy(torch_lambda)  # torch.distributed.fsdp.wrap.CustomPolicy
    if isinstance(policy, (set, list, tuple)):
        raise TypeError(
            "auto_wrap_policy: got a collection; wrap module classes in ModuleWrapPolicy({...})"
        )
    if not callable(policy):
        raise TypeError(
            f"auto_wrap_policy must be a callable (module, recurse, nonwrapped_numel) -> bool "
            f"or a ModuleWrapPolicy/CustomPolicy, got {type(policy).__name__}"
        )
    return policy  # type: ignore[return-value]


def select_units(
    root: nn.Module, policy: PolicyCallable | None, ignored: set[nn.Module]
) -> list[nn.Module]:
    """Modules below ``root`` that become units, in pre-order (root itself excluded)."""
    if policy is None:
        return []
    chosen: list[nn.Module] = []

    def numel(module: nn.Module) -> int:
        seen: set[int] = set()
        total = 0
        for sub in module.modules():
            if sub in ignored:
                continue
            for p in sub.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
        return total

    def visit(module: nn.Module, is_root: bool) -> int:
        if module in ignored:
            return 0
        total = numel(module)
        if policy(module=module, recurse=True, nonwrapped_numel=total):
            position = len(chosen)
            remaining = sum(visit(child, False) for child in module.children())
            remaining += sum(p.numel() for p in module.parameters(recurse=False))
        else:
            position, remaining = len(chosen), total
        if not is_root and policy(module=module, recurse=False, nonwrapped_numel=remaining):
            chosen.insert(position, module)
            return 0
        return remaining

    visit(root, True)
    return chosen
