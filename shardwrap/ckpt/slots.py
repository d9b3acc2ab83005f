"""Where each original tensor of a sharded model lives on this rank.

Checkpoints, state dicts and pretrained loading all need the same map: for every original
parameter (by its name in the unwrapped model), the element range of its flattened form
this rank holds, the ``nn.Parameter`` the optimizer sees for it, and whether this rank is
the one that saves that range (hybrid and ``NO_SHARD`` replicas hold identical copies; the
first replica saves). Parameters outside every unit (ignored modules) are held whole by
every rank and saved by world rank 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import collectives
from ..comm.collectives import Communicator
from ..flat_param import FlatParamHandle
from ..runtime import registry


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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_flat(self) -> torch.Tensor:
        """``local`` as a 1-D view of its ``end - start`` elements."""
        return self.local.detach().reshape(-1)


@dataclass(frozen=True)
class ModelSlots:
    """Every parameter slot of a model, and how state-dict names map onto them."""

    slots: list[ParamSlot]
    by_param: dict[int, ParamSlot]  # id(shard view or full view or plain param) -> slot
    aliases: dict[str, str]  # tied name -> canonical name
    buffers: dict[str, torch.Tensor]  # persistent buffers by state-dict name
    world_comm: Communicator
    # This rank is its data-parallel group's first: it saves what the group holds whole
    # (buffers, parameters outside every unit, scalar optimizer state). World rank 0 but
    # under pipeline parallelism, where each stage has its own ([Note: checkpoints of
    # pipeline stages] in fragments.py).
    leads: bool = True

    def by_name(self) -> dict[str, ParamSlot]:
        return {s.fqn: s for s in self.slots}


def world_communicator(model: nn.Module) -> Communicator:
    """Over every rank: the default group, or the model's own group when there is none.

    Not the model's own group when there is a default one: a pipeline stage's is its data-
    parallel group, and a checkpoint spans every stage ([Note: checkpoints of pipeline
    stages] in fragments.py).
    """
    if collectives.is_initialized():
        return Communicator(collectives.default_group(), model.comm_ledger)
    return Communicator(model._runtime.world_comm.group, model.comm_ledger)


def model_slots(model: nn.Module) -> ModelSlots:
    """The slots of ``model`` (a ``ShardedModule``) on this rank."""
    if not hasattr(model, "units") or not hasattr(model, "comm_ledger"):
        raise TypeError(f"model: expected a ShardedModule, got {type(model).__name__}")
    world_comm = world_communicator(model)
    runtime = registry.runtime_of(model.units[0]) if model.units else None
    leads = (runtime.world_comm if runtime is not None else world_comm).rank == 0
    slots: list[ParamSlot] = []
    by_param: dict[int, ParamSlot] = {}
    for unit in model.units:
        if unit.handle is not None:
            for slot in _handle_slots(unit.handle):
                slots.append(slot)
                by_param[id(slot.local)] = slot
                by_param[id(slot.handle.full_params[slot.index])] = slot
    aliases: dict[str, str] = {}
    for name, param in model.module.named_parameters(remove_duplicate=False):
        slot = by_param.get(id(param))
        if slot is None:
            slot = _plain_slot(name, param, leads)
            slots.append(slot)
            by_param[id(param)] = slot
        elif name != slot.fqn:
            aliases[name] = slot.fqn
    buffers = {
        name: value
        for name, value in model.module.state_dict(keep_vars=True).items()
        if id(value) not in by_param
    }
    return ModelSlots(slots, by_param, aliases, buffers, world_comm, leads)


def _handle_slots(handle: FlatParamHandle) -> list[ParamSlot]:
    saves = handle.replicate_comm is None or handle.replicate_comm.rank == 0
    pieces = handle.pieces
    slots = []
    for index, (info, piece) in enumerate(zip(handle.layout.params, pieces, strict=True)):
        start, end = (
            (0, info.numel) if handle.num_shards == 1 else (piece.param_start, piece.param_end)
        )
        slots.append(
            ParamSlot(
                fqn=info.fqn,
                shape=info.shape,
                dtype=handle.dtype,
                local=handle.shard_params[index],
                start=start,
                end=end,
                saves=saves,
                handle=handle,
                index=index,
            )
        )
    return slots


def _plain_slot(name: str, param: nn.Parameter, saves: bool) -> ParamSlot:
    shape = tuple(param.shape)
    return ParamSlot(name, shape, param.dtype, param, 0, math.prod(shape), saves, None, -1)
