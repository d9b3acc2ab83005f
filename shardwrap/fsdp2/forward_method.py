"""``register_fsdp_forward_method``: a method other than ``forward`` run as a forward.

FSDP2 gathers a module's parameters only around ``module(...)``; a method such as
``generate`` that reads them directly would see this rank's DTensor chunks. Registering
it wraps it, on that one module instance, in the unit's pre- and post-forward steps (the
root's step begins first when the module is a root), as FSDP2's does with its
``_pre_forward``/``_post_forward``; a module ``fully_shard`` was not called on is left as
it is, as FSDP2 leaves it. The engine's wrapper is ``features/forward_methods.py``'s.
FSDP2 also applies the call's ``mp_policy`` casts around the method; the engine's wrapper
does not, so a unit with a mixed-precision policy is refused.
"""

from __future__ import annotations

from torch import nn

from ..assemble.casts import has_casts
from ..features.forward_methods import register_forward_method
from .fully_shard_args import NOT_YET
from .module import FSDPModule
from .state import state_of


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather and free ``module``'s unit like its
    ``forward`` (a no-op when ``module`` is not an :class:`FSDPModule`)."""
    if not isinstance(module, FSDPModule):
        return
    if not isinstance(method_name, str):
        raise TypeError(f"method_name: expected a str, got {method_name!r}")
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"method_name: {type(module).__name__} has no method {method_name!r}")
    state = state_of(module)
    assert state is not None  # an FSDPModule has its call's record
    handle = state.unit.handle
    if (handle is not None and handle.precision is not None) or has_casts(module):
        raise NotImplementedError(
            f"register_fsdp_forward_method on a module with a mixed-precision mp_policy "
            f"{NOT_YET}: FSDP2 casts the method's inputs and outputs; use the default policy"
        )
    register_forward_method(module, method_name)
