"""The name swap the torch suite runs under: ``shardwrap.install()`` and three spellings more.

``install()`` rebinds the public names (``torch.distributed.fsdp`` and
``torch.distributed._composable.fsdp``). torch's test files also import ``fully_shard`` and
``FSDPModule`` from modules inside torch's implementation (for example
``torch.distributed.fsdp._fully_shard._fully_shard``); those spellings name the same two
objects, so the suite binds shardwrap's there too. Anything else a test imports from torch's
implementation (``FSDPParamGroup``, ``_get_managed_modules``, ...) stays torch's: such a test
inspects torch's internals, and the results table says so.
"""

from __future__ import annotations

import importlib

# Modules that hold torch's fully_shard and FSDPModule besides the ones install() rebinds.
PRIVATE_SPELLINGS = (
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.fsdp.fully_shard",
)


def swap_names() -> None:
    """Make every spelling of torch's FSDP2 (and FSDP1's class) name shardwrap's."""
    import shardwrap
    from shardwrap import FSDPModule, fully_shard

    shardwrap.install()
    for module_name in PRIVATE_SPELLINGS:
        module = importlib.import_module(module_name)
        module.fully_shard = fully_shard
        module.FSDPModule = FSDPModule
