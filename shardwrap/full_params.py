"""Full-parameter access outside forward: ``summon_full_params``.

[Note: what summoning does to a handle]
Inside the context each selected unit shows its *full* views (gathered if stale), exactly
as during forward. On exit, with ``writeback``, this rank's slice of the (possibly edited)
gathered buffer is copied into its shard; the copy bumps the shard's version counter, so
the next forward gathers again. Without ``writeback`` edits are dropped: the gathered
buffer is released (or, with a single shard, where the full views *are* the shard, the
values are restored from a snapshot). Every rank must enter the context (it all-gathers),
and edits must be the same on every rank, as with torch's FSDP.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import collectives
from .flat_param import FlatParamHandle, ShardedState
from .hooks import TrainingState, Unit

if TYPE_CHECKING:
    from .wrap import ShardedModule

# Handles inside an active summon; a nested summon leaves them to the outer one.
_SUMMONED: weakref.WeakSet[FlatParamHandle] = weakref.WeakSet()


def units_of(module: nn.Module, recurse: bool) -> list[Unit]:
    """The units ``module`` owns: its own (``recurse=False``) or all in its subtree."""
    from .wrap import _MANAGED, ShardedModule

    top = module.module if isinstance(module, ShardedModule) else module
    if not recurse:
        unit = _MANAGED.get(top)
        if unit is None:
            raise ValueError(
                f"module: {type(module).__name__} is not a ShardedModule or a wrapped unit"
            )
        return [unit]
    found: dict[int, Unit] = {}
    for sub in module.modules():
        unit = _MANAGED.get(sub)
        if unit is not None:
            found.setdefault(id(unit), unit)
    if not found:
        raise ValueError(f"module: {type(module).__name__} contains no ShardedModule units")
    return list(found.values())


def _check_flags(
    recurse: bool, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> None:
    for name, value in (
        ("recurse", recurse),
        ("writeback", writeback),
        ("rank0_only", rank0_only),
        ("offload_to_cpu", offload_to_cpu),
        ("with_grads", with_grads),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {value!r}")
    if writeback and rank0_only:
        raise ValueError("writeback=True with rank0_only=True: other ranks have nothing to write")
    if with_grads and offload_to_cpu:
        raise ValueError("with_grads=True with offload_to_cpu=True is not supported")


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module | ShardedModule,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Show full parameters on ``module``'s units inside the context; see the Note above."""
    _check_flags(recurse, writeback, rank0_only, offload_to_cpu, with_grads)
    units = [u for u in units_of(module, recurse) if u.handle is not None]
    for unit in units:
        if unit.state is TrainingState.BACKWARD:
            raise RuntimeError(f"summon_full_params: unit {unit.name!r} is in backward")
    if with_grads:
        for runtime in {id(u.runtime): u.runtime for u in units if u.runtime}.values():
            runtime.reduce_deferred_grads()  # ZeRO-1: make the gradients reduced shards
    mine = [u.handle for u in units if u.handle not in _SUMMONED]
    showing = not rank0_only or collectives.world_rank() == 0
    summons = [_Summon(h, writeback, showing, offload_to_cpu, with_grads) for h in mine]
    for s in summons:
        _SUMMONED.add(s.handle)
        s.enter()
    try:
        yield
    finally:
        for s in summons:
            s.exit()
            _SUMMONED.discard(s.handle)


class _Summon:
    """One handle's summon: what it showed before, and how to undo or write back."""

    def __init__(
        self, handle: FlatParamHandle, writeback: bool, showing: bool, offload: bool, grads: bool
    ) -> None:
        self.handle = handle
        self.writeback = writeback
        self.showing = showing
        self.offload = offload and handle.flat_full.device.type != "cpu"
        self.with_grads = grads
        self.was_unsharded = handle.state is ShardedState.UNSHARDED
        self.snapshot: torch.Tensor | None = None  # 1D; single shard without writeback
        self.shown: list[nn.Parameter] = []  # CPU copies when offloading

    def enter(self) -> None:
        handle = self.handle
        handle.unshard()
        if handle.num_shards == 1 and not self.writeback:
            self.snapshot = handle.flat_full.detach().clone()
        if self.with_grads:
            _show_full_grads(handle)
        if not self.showing:
            handle.reshard(free=False)
        elif self.offload:
            self.shown = [
                nn.Parameter(p.detach().cpu(), p.requires_grad) for p in handle.full_params
            ]
            handle._show(self.shown)

    def exit(self) -> None:
        handle = self.handle
        with torch.no_grad():
            if self.offload and self.writeback:
                for full, shown in zip(handle.full_params, self.shown, strict=True):
                    full.copy_(shown)
            if self.writeback and handle.num_shards > 1:
                start, end = handle.layout.shard_range(handle.shard_comm.rank)
                handle.flat_shard.copy_(handle.flat_full[start:end])
            if self.snapshot is not None:
                handle.flat_shard.copy_(self.snapshot)
        if self.with_grads:
            for full in handle.full_params:
                full.grad = None  # must not leak into the next backward's accumulation
        handle.reshard(free=True)
        if self.was_unsharded:
            handle.unshard()


def _show_full_grads(handle: FlatParamHandle) -> None:
    """Gather the reduced gradient shards into the full views' ``.grad`` (read-only copies)."""
    present = [p.grad is not None for p in handle.shard_params]
    if handle.num_shards == 1:
        for full, shard in zip(handle.full_params, handle.shard_params, strict=True):
            full.grad = None if shard.grad is None else shard.grad.detach().clone()
        return
    grad_shard = torch.zeros_like(handle.flat_shard)
    pieces = handle.layout.pieces(handle.shard_comm.rank)
    for piece, shard in zip(pieces, handle.shard_params, strict=True):
        if shard.grad is not None:
            grad_shard[piece.shard_start : piece.shard_end].copy_(shard.grad.reshape(-1))
    grad_full = torch.empty_like(handle.flat_full, memory_format=torch.contiguous_format)
    handle.shard_comm.all_gather(grad_full, grad_shard, purpose="summon_grads").wait()
    for info, full, has_grad in zip(handle.layout.params, handle.full_params, present, strict=True):
        full.grad = grad_full[info.offset : info.end].view(info.shape) if has_grad else None
