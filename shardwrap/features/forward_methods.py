"""Run a method other than ``forward`` (``generate``, ``encode``) with gathered parameters.

Forward hooks only fire for ``module(...)``. A method that reads a unit's parameters
directly (``self.head.weight``) or loops over submodules would otherwise see this rank's
1-D shard pieces. :func:`register_forward_method` wraps the method in the unit's
pre/post-forward steps, so it behaves like one forward of that unit: gathered before, and
resharded after (only the outermost call reshards when it calls ``forward`` itself).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from .. import hooks
from ..assemble.root import find_root
from ..runtime import registry


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather ``module``'s unit like ``forward`` does.

    ``module`` is a ``ShardedModule`` (its root unit is used) or a module wrapped as a unit.
    """
    if not isinstance(method_name, str):
        raise TypeError(f"method_name: expected a str, got {method_name!r}")
    root = find_root(module)
    wrapper = module if root is not None else None
    inner = root.module if root is not None else module
    unit = registry.unit_of(inner)
    runtime = registry.runtime_of(unit) if unit is not None else None
    if unit is None or runtime is None:
        raise ValueError(f"module: {type(module).__name__} is not a ShardedModule or a unit")
    method = getattr(inner, method_name, None)
    if not callable(method):
        raise ValueError(f"method_name: {type(inner).__name__} has no method {method_name!r}")

    @functools.wraps(method)
    def gathered(*args: Any, **kwargs: Any) -> Any:
        if wrapper is not None:
            runtime.begin_forward()
        args, kwargs = hooks.pre_forward(unit, runtime, inner, args, kwargs)
        output = method(*args, **kwargs)
        return hooks.post_forward(unit, runtime, inner, args, kwargs, output)

    # Instance attributes shadow the class's method; the original stays reachable there.
    object.__setattr__(inner, method_name, gathered)
    if wrapper is not None:
        object.__setattr__(wrapper, method_name, gathered)
