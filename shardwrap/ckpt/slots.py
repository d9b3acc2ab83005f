"""Where each original tensor of a sharded model lives on this rank.

Checkpoints, state dicts and pretrained loading all need the same map: for every original
parameter (by its name in the unwrapped model), the element range of its flattened form
this rank holds, the ``nn.Parameter`` the optimizer sees for it, and whether this rank is
the one that saves that range (hybrid and ``NO_SHARD`` replicas hold identical copies; the
first replica saves). A tensor-parallel parameter's range indexes its local block, which
maps onto runs of the global tensor (``layout/blocks.py``); its TP replicas (a
``Replicate`` placement) save from mesh coordinate 0. Parameters outside every unit
(ignored modules) are held whole by every rank and saved by world rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..assemble.root import root_of
from ..comm import collectives
from ..comm.collectives import Communicator
from ..core.tensor_parallel import TPSpec, local_tensor
from ..flat_param import FlatParamHandle
from ..layout.blocks import block_runs


def shaped_like(local: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (this rank's elements of ``local``) shaped as ``local`` is: for a
    ``DTensor``, one with the same mesh, placements and global shape whose local tensor
    ``flat`` is (no communication), as the optimizer state of a DTensor parameter is."""
    if not isinstance(local, DTensor):
        return flat.reshape(local.shape)
    piece = flat.reshape(local.to_local().shape)
    return DTensor.from_local(
        piece,
        local.device_mesh,
        local.placements,
        run_check=False,
        shape=local.shape,
        stride=local.stride(),
    )


@dataclass(frozen=True, eq=False)
class ParamSlot:
    """One original parameter as this rank holds it."""

    fqn: str  # canonical name (first in ``named_parameters`` order)
    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype
    local: nn.Parameter  # what the optimizer holds: a 1-D piece, or the whole parameter
    start: int  # flattened elements [start, end) of the parameter held in ``local``
    end: int
    saves: bool  # this rank writes this range to a checkpoint
    handle: FlatParamHandle | None  # None for parameters outside every unit
    index: int  # position in ``handle.layout.params`` (-1 without a handle)
    # A tensor-parallel parameter: ``[start, end)`` then index its local block flattened,
    # not the global tensor; see :meth:`global_runs`.
    tp: TPSpec | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def global_runs(self) -> list[tuple[int, int, int]]:
        """``local_flat()`` as runs ``(lo, hi, global_start)``: its elements ``[lo, hi)``
        are the global tensor's flattened elements from ``global_start`` on."""
        if self.tp is None:
            return [(0, self.end - self.start, self.start)] if self.end > self.start else []
        return [
            (lo - self.start, hi - self.start, g)
            for lo, hi, g in block_runs(self.tp.block, self.start, self.end)
        ]

    def saved_pieces(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor, int]]:
        """``value`` (shaped like ``local``) as the checkpoint's pieces: ``(key suffix, 1-D
        piece, global start)``; a TP block's are its runs, keyed ``@<global start>``."""
        flat = local_tensor(value).detach().reshape(-1)
        if self.tp is None:
            return [("", flat, self.start)]
        return [(f"@{g}", flat[lo:hi], g) for lo, hi, g in self.global_runs()]

    def global_ranges(self) -> list[tuple[int, int]]:
        """The global tensor's flattened ranges ``[start, end)`` that ``local_flat()``
        holds, in its order (one empty range when it holds none of a TP block)."""
        if self.tp is None:
            return [(self.start, self.end)]
        return [(g, g + hi - lo) for lo, hi, g in self.global_runs()] or [(0, 0)]

    def read_local(self, read: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """This rank's ``end - start`` elements, from ``read(global_start, global_end)``
        over :meth:`global_ranges`."""
        parts = [read(start, end) for start, end in self.global_ranges()]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def piece_of_whole(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece (1-D, ``end - start``) of ``whole``, a global-shape tensor."""
        local = whole if self.tp is None else self.tp.local_of(whole)
        return local.reshape(-1)[self.start : self.end]

    def local_flat(self) -> torch.Tensor:
        """``local`` as a 1-D view of its ``end - start`` elements."""
        return local_tensor(self.local).detach().reshape(-1)


@dataclass(frozen=True)
class ModelSlots:
    """Every parameter slot of a model, and how state-dict names map onto them."""

    slots: list[ParamSlot]
    by_param: dict[int, ParamSlot]  # id(shard view or full view or plain param) -> slot
    aliases: dict[str, str]  # tied name -> canonical name
    buffers: dict[str, torch.Tensor]  # persistent buffers by state-dict name
    world_comm: Communicator
    # This rank is its data-parallel group's first (and coordinate 0 of its tensor-parallel
    # meshes): it saves what the group holds whole (buffers, parameters outside every unit,
    # scalar optimizer state). World rank 0 but under pipeline parallelism, where each stage
    # has its own ([Note: checkpoints of pipeline stages] in fragments.py).
    leads: bool = True

    def by_name(self) -> dict[str, ParamSlot]:
        return {s.fqn: s for s in self.slots}


def world_communicator(model: nn.Module) -> Communicator:
    """Over every rank: the default group, or the model's own group when there is none.

    Not the model's own group when there is a default one: a pipeline stage's is its data-
    parallel group, and a checkpoint spans every stage ([Note: checkpoints of pipeline
    stages] in fragments.py).
    """
    root = root_of(model)
    if root.runtime.world_comm.size > 1:  # an offline group is refused here, by name
        root.runtime.world_comm.check_can_communicate()
    if collectives.is_initialized():
        return Communicator(collectives.default_group(), root.comm_ledger)
    return Communicator(root.runtime.world_comm.group, root.comm_ledger)


def model_slots(model: nn.Module) -> ModelSlots:
    """The slots of ``model`` (a ``ShardedModule``) on this rank."""
    root = root_of(model)
    world_comm = world_communicator(model)
    slots: list[ParamSlot] = []
    by_param: dict[int, ParamSlot] = {}
    handles = [u.handle for u in root.units if u.handle is not None]
    lead = _tp_lead(handles)
    # The first data-parallel rank of its stage, and of its tensor-parallel replicas.
    leads = lead and root.runtime.world_comm.rank == 0
    for handle in handles:
        for slot in _handle_slots(handle, lead):
            slots.append(slot)
            by_param[id(slot.local)] = slot
            by_param[id(slot.handle.full_params[slot.index])] = slot
    aliases: dict[str, str] = {}
    for name, param in root.module.named_parameters(remove_duplicate=False):
        slot = by_param.get(id(param))
        if slot is None:
            slot = _plain_slot(name, param, leads)
            slots.append(slot)
            by_param[id(param)] = slot
        elif name != slot.fqn:
            aliases[name] = slot.fqn
    buffers = {
        name: value
        for name, value in root.module.state_dict(keep_vars=True).items()
        if id(value) not in by_param
    }
    return ModelSlots(slots, by_param, aliases, buffers, world_comm, leads)


def _tp_lead(handles: list[FlatParamHandle]) -> bool:
    """Whether this rank is coordinate 0 on every tensor-parallel mesh of the model: of
    the TP ranks that hold a plain (replicated) parameter alike, the one that saves it."""
    meshes = {id(s.mesh): s.mesh for h in handles for s in h.tp_specs if s is not None}
    return all(c == 0 for mesh in meshes.values() for c in mesh.get_coordinate())


def _handle_slots(handle: FlatParamHandle, tp_lead: bool) -> list[ParamSlot]:
    saves = handle.replicate_comm is None or handle.replicate_comm.rank == 0
    pieces = handle.pieces
    slots = []
    for index, (info, piece) in enumerate(zip(handle.layout.params, pieces, strict=True)):
        start, end = (
            (0, info.numel) if handle.num_shards == 1 else (piece.param_start, piece.param_end)
        )
        tp = handle.tp_specs[index]
        slots.append(
            ParamSlot(
                fqn=info.fqn,
                shape=info.shape if tp is None else tp.block.global_shape,
                dtype=handle.dtype,
                local=handle.shard_params[index],
                start=start,
                end=end,
                saves=saves and (tp_lead if tp is None else tp.is_first_replica),
                handle=handle,
                index=index,
                tp=tp,
            )
        )
    return slots


def _plain_slot(name: str, param: nn.Parameter, saves: bool) -> ParamSlot:
    shape = tuple(param.shape)
    return ParamSlot(name, shape, param.dtype, param, 0, math.prod(shape), saves, None, -1)
