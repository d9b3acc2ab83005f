"""Deferred initialisation: materialise (and optionally broadcast) one unit at a time.

[Note: unit-by-unit materialisation]
A model built on ``torch.device("meta")`` has no storage. Right before a unit's handle is
built, the modules in that unit's *region* (its subtree minus nested units and ignored
modules), plus the modules where its parameters are registered, get real storage: through
``param_init_fn(module)``, called once per module that owns meta tensors directly (as in
FSDP1, so the function should materialise only ``module``'s own tensors, e.g.
``module.to_empty(device=..., recurse=False)`` and an init), or else through
``module.to_empty(recurse=False)`` and ``module.reset_parameters()``. The handle then copies
the values into its shard and the module shows shard views, so the full tensors die before
the next unit is materialised: a rank holds at most one unit unsharded at a time.

``to_empty`` replaces parameters, which unties shared ones; the recorded sites re-tie them
to the tensor at the first site (``named_parameters`` order), as the eager model would.
With ``sync_module_states`` the same region's parameters and buffers are broadcast from
rank 0 right after materialising, so ranks seeded differently end up equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..comm.collectives import Communicator
from ..layout.partition import ParamRecord


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _owns_meta(module: nn.Module) -> bool:
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.is_meta for t in own)


class UnitMaterializer:
    """Materialise and synchronise the modules of one unit right before it is sharded."""

    def __init__(
        self,
        root: nn.Module,
        unit_modules: Iterable[nn.Module],
        ignored: set[nn.Module],
        param_init_fn: Callable[[nn.Module], None] | None,
        device: torch.device,
        sync_comm: Communicator | None,
    ) -> None:
        if param_init_fn is not None and not callable(param_init_fn):
            raise TypeError("param_init_fn: expected a callable taking a module")
        self.param_init_fn = param_init_fn
        self.device = device
        self.sync_comm = sync_comm  # None: no sync_module_states
        self.ignored_ids = {id(m) for top in ignored for m in top.modules()}
        self.names = {id(m): name or "<root>" for name, m in root.named_modules()}
        self.region_of: dict[int, int] = {}  # id(module) -> id(its nearest unit module)
        self._assign_regions(root, id(root), {id(m) for m in unit_modules})

    def _assign_regions(self, module: nn.Module, owner: int, unit_ids: set[int]) -> None:
        if id(module) in self.ignored_ids:
            return
        owner = id(module) if id(module) in unit_ids else owner
        self.region_of.setdefault(id(module), owner)
        for child in module.children():
            self._assign_regions(child, owner, unit_ids)

    def prepare(self, unit_module: nn.Module, records: list[ParamRecord], root: nn.Module):
        """Give this unit's tensors storage (and rank 0's values) before it is sharded."""
        region = [m for m in root.modules() if self.region_of.get(id(m)) == id(unit_module)]
        sites = [s.module for r in records for s in r.sites]
        for module in _unique([*region, *sites]):
            if _owns_meta(module):
                self._materialize(module)
        for record in records:
            first = record.sites[0]
            record.param = first.module._parameters[first.attr]
            for site in record.sites[1:]:
                site.set(record.param)  # re-tie what to_empty untied
        if self.sync_comm is not None:
            tensors = [r.param for r in records]
            tensors += [b for m in region for b in m.buffers(recurse=False)]
            self._broadcast(tensors)

    def finish(self, root: nn.Module, ignored: set[nn.Module]) -> None:
        """Materialise what no unit covered (ignored modules); sync their tensors too."""
        leftover = [m for top in ignored for m in top.modules() if _owns_meta(m)]
        for module in leftover:
            self._materialize(module)
        if self.sync_comm is not None:
            tensors = [t for top in ignored for t in [*top.parameters(), *top.buffers()]]
            self._broadcast(tensors)
        still_meta = [n for n, t in [*root.named_parameters(), *root.named_buffers()] if t.is_meta]
        if still_meta:
            raise ValueError(f"param_init_fn: left {still_meta[:5]} on the meta device")

    def _materialize(self, module: nn.Module) -> None:
        if self.param_init_fn is not None:
            self.param_init_fn(module)
            return
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            # to_empty alone would leave whatever bytes the allocator returned: refuse.
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            names = [name for name, tensor in own if tensor.is_meta]
            raise ValueError(
                f"param_init_fn: module {self.names.get(id(module), '?')!r} "
                f"({type(module).__name__}) has {names} on the meta device and no "
                "reset_parameters() to initialise them; pass param_init_fn, or build that "
                "module off the meta device"
            )
        module.to_empty(device=self.device, recurse=False)
        with torch.no_grad():
            reset()

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for tensor in _unique(tensors):
                if tensor.is_meta:
                    raise ValueError("sync_module_states: a tensor is still on the meta device")
                self.sync_comm.broadcast(tensor.data, src_rank=0, purpose="init").wait()


def _unique(items: list) -> list:
    seen: set[int] = set()
    out = []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out
