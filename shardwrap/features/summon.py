"""Full-parameter access outside forward: ``summon_full_params``.

[Note: what summoning does to a handle]
Inside the context each selected unit shows full parameters gathered into a temporary
buffer in the *master* dtype (so mixed precision shows fp32 values, not the low-precision
compute copy); the handle's own gathered buffer and its gradients are left alone. On exit,
with ``writeback``, this rank's slice of the (possibly edited) buffer is copied into its
shard; the copy bumps the shard's version counter, so the next forward gathers again.
With a single shard the shown parameters are the shard itself (edited in place), or a
copy when ``writeback=False``. Every rank must enter the context (it all-gathers), and
edits must be the same on every rank, as with torch's FSDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..assemble.root import own_unit
from ..comm import collectives
from ..core.unit import TrainingState, Unit
from ..flat_param import FlatParamHandle, ShardedState
from ..runtime import registry
from ..runtime.step import regather


def units_of(module: nn.Module, recurse: bool) -> list[Unit]:
    """The units ``module`` owns: its own (``recurse=False``) or all in its subtree."""
    if not recurse:
        unit = own_unit(module)
        if unit is None:
            raise ValueError(
                f"module: {type(module).__name__} is not a ShardedModule or a wrapped unit"
            )
        return [unit]
    found: dict[int, Unit] = {}
    for sub in module.modules():
        unit = own_unit(sub)
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


def _world_rank(units: list) -> int:
    """This rank in the units' world (their root's, which may have no default group)."""
    runtime = registry.runtime_of(units[0]) if units else None
    return runtime.world_comm.rank if runtime is not None else collectives.world_rank()


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Show full parameters on ``module``'s units inside the context; see the Note above."""
    _check_flags(recurse, writeback, rank0_only, offload_to_cpu, with_grads)
    selected = units_of(module, recurse)
    units = [u for u in selected if u.handle is not None]
    for unit in units:
        if unit.state is TrainingState.BACKWARD:
            raise RuntimeError(f"summon_full_params: unit {unit.name!r} is in backward")
    if with_grads:
        runtimes = [registry.runtime_of(u) for u in units]
        for runtime in {id(r): r for r in runtimes if r is not None}.values():
            runtime.reduce_deferred_grads()  # ZeRO-1 grads that no_sync backwards left local
    # Every selected unit is marked, owning parameters or not (FSDP1's training_state reads
    # SUMMON_FULL_PARAMS on each: runtime/fsdp1_state.py); a nested summon marks and shows
    # only the units an outer one does not.
    marked = registry.add_summoned_units(selected)
    mine = {id(u) for u in marked}
    showing = not rank0_only or _world_rank(units) == 0
    summons = [
        _Summon(u.handle, writeback, showing, offload_to_cpu, with_grads)
        for u in units
        if id(u) in mine
    ]
    for s in summons:
        s.enter()
    try:
        yield
    finally:
        registry.discard_summoned_units(marked)
        for s in summons:
            s.exit()


class _Summon:
    """One handle's summon: a full-precision full copy shown on the module, then undone."""

    def __init__(
        self, handle: FlatParamHandle, writeback: bool, showing: bool, offload: bool, grads: bool
    ) -> None:
        self.handle = handle
        self.writeback = writeback
        self.showing = showing
        self.offload = offload and handle.compute_device.type != "cpu"
        self.with_grads = grads
        self.flat_full: torch.Tensor | None = None  # 1D, padded, master dtype; while summoned

    def enter(self) -> None:
        handle = self.handle
        if handle.num_shards == 1:
            # The shard is the whole parameter: edit it in place, or a copy to be dropped.
            flat = handle.flat_shard if self.writeback else handle.flat_shard.detach().clone()
        else:
            flat = torch.empty(
                handle.layout.padded_numel, dtype=handle.dtype, device=handle.compute_device
            )
            source = handle.flat_shard.detach().to(handle.compute_device)  # CPUOffload: host
            handle.shard_comm.all_gather(flat, source, purpose="summon").wait()
        self.flat_full = flat.cpu() if self.offload else flat
        # Tensor-parallel parameters show as DTensors (global shape, this rank's block).
        count = len(handle.layout.params)
        shown = [handle.full_param_of(self.flat_full, index) for index in range(count)]
        if self.with_grads:
            _attach_full_grads(handle, shown)
        if self.showing:
            handle.show_params(shown)

    def exit(self) -> None:
        handle = self.handle
        flat = self.flat_full
        self.flat_full = None
        if self.writeback and (handle.num_shards > 1 or self.offload):
            start, end = handle.layout.shard_range(handle.shard_comm.rank)
            with torch.no_grad():
                # Bumps flat_shard's version: the next forward gathers the new values.
                handle.flat_shard.copy_(flat[start:end] if handle.num_shards > 1 else flat)
        unsharded = handle.state is ShardedState.UNSHARDED
        handle.show_params(handle.full_params if unsharded else handle.shard_params)
        if unsharded and self.writeback:
            regather(handle)  # the shown full views must reflect the edits


def _attach_full_grads(handle: FlatParamHandle, shown: list[nn.Parameter]) -> None:
    """Give ``shown`` copies of the full reduced gradients (edits are not written back)."""
    if handle.num_shards == 1:
        for index, (param, shard) in enumerate(zip(shown, handle.shard_params, strict=True)):
            if shard.grad is not None:
                param.grad = _as_shown(handle, index, shard.grad.detach().clone())
        return
    grad_shard = torch.zeros_like(handle.flat_shard)
    pieces = handle.pieces
    for piece, shard in zip(pieces, handle.shard_params, strict=True):
        if shard.grad is not None:
            grad_shard[piece.shard_start : piece.shard_end].copy_(shard.grad.reshape(-1))
    grad_full = torch.empty(
        handle.layout.padded_numel, dtype=handle.dtype, device=handle.compute_device
    )
    grad_shard = grad_shard.to(handle.compute_device)  # CPUOffload: gradients are on the host
    handle.shard_comm.all_gather(grad_full, grad_shard, purpose="summon_grads").wait()
    infos = handle.layout.params
    for index, (info, param, shard) in enumerate(
        zip(infos, shown, handle.shard_params, strict=True)
    ):
        if shard.grad is not None:  # the same on every rank (the presence vote)
            grad = grad_full[info.offset : info.end].view(info.shape)
            param.grad = _as_shown(handle, index, grad)


def _as_shown(handle: FlatParamHandle, index: int, grad: torch.Tensor) -> torch.Tensor:
    spec = handle.tp_specs[index]
    return grad if spec is None else spec.wrap(grad.view(spec.block.shape))
