"""``shardwrap.install()``: code that builds torch's FSDP1 builds shardwrap's instead.

Frameworks build ``FullyShardedDataParallel`` themselves (accelerate's ``prepare``, the
Hugging Face ``Trainer`` with ``fsdp=...``, Lightning's FSDP strategy); their users never
write the call. ``install()`` rebinds torch's name for the class, in every torch module
that holds it, to ``shardwrap.FullyShardedDataParallel``; code that looks the name up when
it runs (accelerate imports it inside the functions that wrap, check and save) then builds
and recognises ours. ``uninstall()`` restores torch's. Call ``install()`` before the
framework code runs; a module that bound torch's class at its own import, before
``install()``, keeps it.

Torch's option objects (``CPUOffload``, ``MixedPrecision``, ``ShardingStrategy``, the
state-dict configs, the wrap policies) need no rebinding: shardwrap accepts them as they
are.
"""

from __future__ import annotations

import importlib
from typing import Any

from .wrap import FullyShardedDataParallel

# Torch modules that bind FSDP1's class under its name.
_HOLDERS = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp.fully_sharded_data_parallel",
)
_NAME = "FullyShardedDataParallel"
# module name -> torch's original class, while installed.
_ORIGINALS: dict[str, Any] = {}


def install() -> None:
    """Make torch's ``FullyShardedDataParallel`` name build shardwrap's (idempotent)."""
    for module_name in _HOLDERS:
        module = importlib.import_module(module_name)
        if module_name not in _ORIGINALS:
            _ORIGINALS[module_name] = getattr(module, _NAME)
        setattr(module, _NAME, FullyShardedDataParallel)


def uninstall() -> None:
    """Give torch's modules their own ``FullyShardedDataParallel`` back (idempotent)."""
    for module_name, original in list(_ORIGINALS.items()):
        setattr(importlib.import_module(module_name), _NAME, original)
        del _ORIGINALS[module_name]


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_ORIGINALS)
