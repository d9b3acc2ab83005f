"""Mixed precision at wrap time: cast buffers, and the cast hooks of full-precision modules.

The dtypes a handle uses are in ``core/precision.py`` ([Note: mixed-precision data flow]).

Modules of ``module_classes_to_ignore`` (BatchNorm by default) become units of their own
that compute in full precision: their floating inputs are cast up and their floating
outputs cast back to ``param_dtype``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..base.torch_compat import tree_map
from ..options import MixedPrecision

if TYPE_CHECKING:
    from ..core.unit import Unit


def excluded_modules(root: nn.Module, policy: MixedPrecision | None) -> list[nn.Module]:
    """Modules that must compute in full precision (each becomes its own unit)."""
    if policy is None or not policy.module_classes_to_ignore:
        return []
    classes = tuple(policy.module_classes_to_ignore)
    return [m for m in root.modules() if isinstance(m, classes) and m is not root]


def cast_buffers(root: nn.Module, policy: MixedPrecision | None, keep: Iterable[nn.Module]):
    """Cast floating buffers to ``buffer_dtype``, except inside modules in ``keep``."""
    if policy is None or policy.buffer_dtype is None:
        return
    kept = {id(m) for top in keep for m in top.modules()}
    for module in root.modules():
        if id(module) in kept:
            continue
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(policy.buffer_dtype)


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, value)


class _CastInputs:
    """Forward pre-hook: cast floating positional and keyword inputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast_floating(args, self.dtype), _cast_floating(kwargs, self.dtype)


class _CastOutput:
    """Forward hook: cast floating outputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast_floating(output, self.dtype)


def cast_outputs(module: nn.Module, dtype: torch.dtype) -> Any:
    """Cast ``module``'s floating outputs to ``dtype`` after its forward (a forward hook
    registered now, so after those before it); returns the hook handle."""
    return module.register_forward_hook(_CastOutput(dtype))


def cast_inputs(module: nn.Module, dtype: torch.dtype) -> Any:
    """Cast ``module``'s floating inputs to ``dtype`` before its forward (a forward pre-hook
    registered now, so after those before it); returns the hook handle."""
    return module.register_forward_pre_hook(_CastInputs(dtype), with_kwargs=True)


def install_casts(
    units: list[Unit], root: nn.Module, policy: MixedPrecision | None, full_precision: set[int]
) -> list[Any]:
    """Register input/output casts on units; returns the hook handles.

    ``full_precision`` holds ``id``s of the unit modules that compute in full precision.
    Registered after the units' own hooks, so casts see the inputs those hooks return.
    """
    if policy is None or policy.param_dtype is None:
        return []
    hooks = []
    low = policy.param_dtype
    for unit in units:
        module = unit.module
        if id(module) in full_precision:
            master = unit.handle.dtype if unit.handle is not None else torch.float32
            hooks.append(module.register_forward_pre_hook(_CastInputs(master), with_kwargs=True))
            hooks.append(module.register_forward_hook(_CastOutput(low)))
        elif (module is root and policy.cast_root_forward_inputs) or policy.cast_forward_inputs:
            hooks.append(module.register_forward_pre_hook(_CastInputs(low), with_kwargs=True))
    return hooks


def has_casts(module: nn.Module) -> bool:
    """Whether a mixed-precision input or output cast is hooked on ``module``."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return any(isinstance(hook, (_CastInputs, _CastOutput)) for hook in hooks)
