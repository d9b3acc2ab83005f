"""``shardwrap.install()``: code that builds torch's FSDP1 (or FSDP2) builds shardwrap's.

Frameworks build ``FullyShardedDataParallel`` themselves (accelerate's ``prepare``, the
Hugging Face ``Trainer`` with ``fsdp=...``, Lightning's FSDP strategy); their users never
write the call. ``install()`` rebinds torch's name for the class, in every torch module
that holds it, to ``shardwrap.FullyShardedDataParallel``; code that looks the name up when
it runs (accelerate imports it inside the functions that wrap, check and save) then builds
and recognises ours. FSDP2's ``fully_shard`` and ``FSDPModule`` (in
``torch.distributed.fsdp`` and ``torch.distributed._composable.fsdp``) are rebound too, and
so is ``register_fsdp_forward_method``, to one that hands a shardwrap module to shardwrap's
and anything else to torch's.
``uninstall()`` restores torch's. Call ``install()`` before the framework code runs; a
module that bound torch's class at its own import, before ``install()``, keeps it.

``torch.distributed.checkpoint.state_dict``'s ``get_state_dict``, ``set_state_dict``,
``get_model_state_dict``, ``get_optimizer_state_dict``, ``set_model_state_dict`` and
``set_optimizer_state_dict`` are rebound too, to functions that hand a shardwrap model to
:mod:`shardwrap.ckpt.dcp` and anything else to torch's:
torch's own would key the optimizer state of a shardwrap model by this rank's pieces, and
DCP would then keep one rank's piece per key.

Torch's option objects (``CPUOffload``, ``MixedPrecision``, ``ShardingStrategy``, the
state-dict configs, the wrap policies) need no rebinding: shardwrap accepts them as they
are.
"""

from __future__ import annotations

import importlib
from typing import Any

from .assemble.root import is_root
from .ckpt import dcp
from .fsdp2 import FSDPModule, fully_shard, register_fsdp_forward_method
from .fsdp2.state import state_of
from .wrap import FullyShardedDataParallel

_DSD = "torch.distributed.checkpoint.state_dict"
# (torch module, name) -> what install() binds there.
_REBOUND: dict[tuple[str, str], Any] = {
    ("torch.distributed.fsdp", "FullyShardedDataParallel"): FullyShardedDataParallel,
    (
        "torch.distributed.fsdp.fully_sharded_data_parallel",
        "FullyShardedDataParallel",
    ): FullyShardedDataParallel,
}
# FSDP2's entry point and class: code that calls torch's fully_shard builds shardwrap's,
# and isinstance(m, torch's FSDPModule) holds for it.
for _module_name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
    _REBOUND[(_module_name, "fully_shard")] = fully_shard
    _REBOUND[(_module_name, "FSDPModule")] = FSDPModule
# (torch module, name) -> torch's original, while installed.
_ORIGINALS: dict[tuple[str, str], Any] = {}


def _forward_method_for(module_name: str) -> Any:
    """torch's ``register_fsdp_forward_method`` there, or shardwrap's for a door module:
    torch's reads its own FSDP state, which a door module has not; a module torch's
    ``fully_shard`` built before ``install()`` keeps torch's."""

    def register(module, method_name):
        if isinstance(module, FSDPModule):
            return register_fsdp_forward_method(module, method_name)
        return _ORIGINALS[(module_name, "register_fsdp_forward_method")](module, method_name)

    register.__name__ = register.__qualname__ = "register_fsdp_forward_method"
    register.__doc__ = "torch's, or shardwrap's for a shardwrap FSDPModule (install())."
    return register


for _module_name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
    _REBOUND[(_module_name, "register_fsdp_forward_method")] = _forward_method_for(_module_name)


def _holds_shardwrap(model: Any) -> bool:
    """Whether ``model`` holds an FSDP1-door root. An FSDP2-door model is FSDP2 to torch's
    state-dict functions (DTensor parameters), so they serve it themselves."""
    return any(is_root(m) and state_of(m) is None for m in model.modules())


def _dispatch(name: str, ours: Any) -> Any:
    def call(model, *args, **kwargs):
        if _holds_shardwrap(model):
            if kwargs.pop("submodules", None) is not None:
                raise ValueError(
                    f"{name}: submodules= (deprecated in torch) is not supported for a "
                    "shardwrap model; take the whole state dict and select its keys"
                )
            return ours(model, *args, **kwargs)
        return _ORIGINALS[(_DSD, name)](model, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"torch's ``{name}``, or shardwrap's for a shardwrap model (install())."
    return call


# Every public function of torch's module that takes a model and its optimizers.
DSD_FUNCTIONS = (
    "get_state_dict",
    "set_state_dict",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
)
for _name in DSD_FUNCTIONS:
    _REBOUND[(_DSD, _name)] = _dispatch(_name, getattr(dcp, _name))


def install() -> None:
    """Make torch's FSDP1 class name build shardwrap's (idempotent); see the module doc."""
    # Every module imported, and every original taken, before any name is rebound: a module
    # imported later would bind the rebound names at its import (torch's
    # ``_composable.fsdp`` imports ``fully_shard`` from ``torch.distributed.fsdp``), and
    # they would pass for torch's originals, which uninstall() then never gave back.
    modules = {module_name: importlib.import_module(module_name) for module_name, _ in _REBOUND}
    for (module_name, name), _value in _REBOUND.items():
        _ORIGINALS.setdefault((module_name, name), getattr(modules[module_name], name))
    for (module_name, name), value in _REBOUND.items():
        setattr(modules[module_name], name, value)


def uninstall() -> None:
    """Give torch's modules their own names back (idempotent)."""
    for (module_name, name), original in list(_ORIGINALS.items()):
        setattr(importlib.import_module(module_name), name, original)
        del _ORIGINALS[(module_name, name)]


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_ORIGINALS)
