"""``deepspeed.zero`` for ``import shardwrap as deepspeed``: ``Init`` and ``GatheredParameters``.

[Note: zero.Init is a no-op]
DeepSpeed's ``zero.Init`` partitions each parameter as the model's ``__init__`` creates it,
so a model larger than one device's memory can be built. shardwrap's way to that end is a
model built on the meta device and materialised unit by unit when it is wrapped
(``ShardedModule(param_init_fn=...)``, docs/training.md). Building on meta inside ``Init``
would silently drop any initialisation the model's ``__init__`` does beyond
``reset_parameters`` (Hugging Face's ``post_init``, a custom ``nn.init``), so ``Init`` here
accepts DeepSpeed's arguments and builds the model as usual: every rank holds the whole
model until ``initialize`` shards it. The weights are then exactly those of a build
without ``Init``.

``GatheredParameters(params, modifier_rank=None)`` shows the full parameters of the units
that hold ``params`` inside the block (``summon_full_params`` on those units), read the
module attributes (``model.layer.weight``) inside the block to see them; with
``modifier_rank`` set, that rank's values are broadcast and written back into every
rank's shard on exit, otherwise edits are dropped. Every rank must enter it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..core.unit import Unit
from ..features.summon import summon_full_params
from ..runtime import registry


class Init(contextlib.ContextDecorator):
    """DeepSpeed's ``zero.Init``: accepted, builds the model as usual ([Note: zero.Init ...])."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: Any = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **kwargs: Any,
    ) -> None:
        self.module = module
        self.enabled = enabled
        self.dtype = dtype

    def __enter__(self) -> Init:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False


def _units_holding(params: list[torch.Tensor]) -> list[tuple[nn.Module, Unit]]:
    """The wrapped units whose handles hold any of ``params`` (in wrap order)."""
    wanted = {id(p) for p in params}
    found = []
    for module, unit in registry.managed_units():
        handle = unit.handle
        if handle is None:
            continue
        if any(id(p) in wanted for p in [*handle.shard_params, *handle.shown_params()]):
            found.append((module, unit))
    return found


@contextlib.contextmanager
def GatheredParameters(  # noqa: N802 - DeepSpeed's name
    params: torch.Tensor | Iterable[torch.Tensor],
    modifier_rank: int | None = None,
    fwd_module: nn.Module | None = None,
    enabled: bool = True,
) -> Iterator[None]:
    """Full parameters inside the block; ``modifier_rank``'s edits kept ([Note: zero.Init ...])."""
    del fwd_module
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in params if p is not None]
    units = _units_holding(params) if enabled else []
    if not units:
        yield
        return
    with contextlib.ExitStack() as stack:
        for module, _ in units:
            stack.enter_context(
                summon_full_params(module, recurse=False, writeback=modifier_rank is not None)
            )
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                for _, unit in units:
                    world = registry.runtime_of(unit).world_comm
                    for shown in unit.handle.shown_params():
                        work = world.broadcast(
                            shown.data, src_rank=modifier_rank, purpose="gathered_parameters"
                        )
                        work.wait()
