"""``SHARDED_STATE_DICT`` values as ``DTensor``s, so ``torch.distributed.checkpoint`` reshards.

[Note: DTensor state dicts]
A unit's flat shard cuts its parameters at arbitrary element offsets, and no ``DTensor``
placement describes such a piece. So, as FSDP1 does with a device mesh, a sharded state
dict re-chunks every parameter along dim 0 over the unit's shard group (``torch.chunk``
sizes: ``ceil(rows / shards)`` rows per rank, the last ranks possibly short or empty) and
wraps the chunk as ``DTensor.from_local(chunk, mesh, [Shard(0)], shape=, stride=)``.
Hybrid units use a 2-D mesh (replicate, shard) with ``[Replicate(), Shard(0)]``, so DCP
writes each chunk once. Units that are not sharded (``NO_SHARD``, persistent units),
parameters outside every unit and 0-dim parameters give plain whole tensors: equal on
every rank, DCP deduplicates them.

The bytes move through the unit's ``Communicator``: saving all-gathers the unit (one
unit at a time, purpose ``"sharded_state_dict"``) and keeps this rank's chunk; loading
all-gathers every rank's chunk (padded to the full chunk size) and keeps this rank's flat
piece (purpose ``"load_sharded_state_dict"``). Optimizer state shaped like a parameter
(Adam's moments) is treated the same way, one state name at a time.

Loading accepts, per parameter: a ``DTensor`` laid out as above (what DCP fills in place),
any other ``DTensor`` (made whole with ``full_tensor()``, torch's collective), or a plain
tensor of the parameter's global shape.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..comm import collectives
from ..comm.collectives import Communicator
from ..flat_param import FlatParamHandle
from .optim_state import SHARDED, state_kind, unit_state_shards
from .slots import ModelSlots, ParamSlot

SAVE_PURPOSE = "sharded_state_dict"
LOAD_PURPOSE = "load_sharded_state_dict"

_MESHES: weakref.WeakKeyDictionary[FlatParamHandle, DeviceMesh] = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------ meshes and chunks
def unit_mesh(handle: FlatParamHandle, world_comm: Communicator) -> DeviceMesh:
    """The device mesh of a sharded unit: (shard,) or (replicate, shard) for hybrid units."""
    mesh = _MESHES.get(handle)
    if mesh is not None:
        return mesh
    device_type = handle.compute_device.type
    shard_group = handle.shard_comm.group
    replicate = handle.replicate_comm
    if replicate is None or replicate.size == 1:
        mesh = DeviceMesh.from_group(shard_group, device_type, mesh_dim_names=("shard",))
    else:
        rows = world_comm.all_gather_object(
            (replicate.rank, collectives.group_ranks(shard_group)), purpose="device_mesh"
        )
        table = dict(rows)  # type: ignore[arg-type]
        ranks = torch.tensor([table[i] for i in range(replicate.size)], dtype=torch.int)
        mesh = DeviceMesh.from_group(
            [replicate.group, shard_group],
            device_type,
            mesh=ranks,
            mesh_dim_names=("replicate", "shard"),
        )
    _MESHES[handle] = mesh
    return mesh


def _placements(mesh: DeviceMesh) -> tuple:
    return (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))


def chunk_rows(rows: int, num_shards: int, rank: int) -> tuple[int, int, int]:
    """``(first row, end row, full chunk rows)`` of ``rank``'s ``torch.chunk`` piece."""
    full = -(-rows // num_shards) if rows else 0
    start = min(rank * full, rows)
    return start, min(start + full, rows), full


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _is_chunked(handle: FlatParamHandle | None, shape: tuple[int, ...]) -> bool:
    return handle is not None and handle.num_shards > 1 and len(shape) > 0


def _to_dtensor(
    handle: FlatParamHandle, world_comm: Communicator, full: torch.Tensor
) -> torch.Tensor:
    """This rank's dim-0 chunk of ``full`` (a whole parameter-shaped tensor)."""
    shape = tuple(full.shape)
    if not _is_chunked(handle, shape):
        return full.clone()
    start, end, _ = chunk_rows(shape[0], handle.num_shards, handle.shard_comm.rank)
    mesh = unit_mesh(handle, world_comm)
    return DTensor.from_local(
        full[start:end].clone(),
        mesh,
        _placements(mesh),
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )


def _gather(handle: FlatParamHandle, local_flat: torch.Tensor, purpose: str) -> torch.Tensor:
    """All-gather a shard-sized 1-D tensor of ``handle`` (on its compute device)."""
    local_flat = local_flat.to(handle.compute_device)
    full = torch.empty(handle.layout.padded_numel, dtype=local_flat.dtype, device=local_flat.device)
    handle.shard_comm.all_gather(full, local_flat, purpose=purpose, unit=handle.comm_label).wait()
    return full


def _unit_slots(slots: ModelSlots) -> tuple[list[FlatParamHandle], dict[int, list[ParamSlot]]]:
    handles: dict[int, FlatParamHandle] = {}
    by_handle: dict[int, list[ParamSlot]] = {}
    for slot in slots.slots:
        if slot.handle is not None:
            handles.setdefault(id(slot.handle), slot.handle)
            by_handle.setdefault(id(slot.handle), []).append(slot)
    return list(handles.values()), by_handle


# ------------------------------------------------------------------------------ saving
def _refuse_tensor_parallel(slots: ModelSlots) -> None:
    tp = [s.fqn for s in slots.slots if s.tp is not None]
    if tp:
        raise ValueError(
            f"state_dict_type: SHARDED_STATE_DICT is not supported for tensor-parallel "
            f"(DTensor) parameters such as {tp[0]!r}; use FULL_STATE_DICT or "
            "shardwrap.save_checkpoint"
        )


def sharded_params(slots: ModelSlots) -> dict[str, torch.Tensor]:
    """Every parameter as a ``DTensor`` chunk (or a plain whole tensor), by canonical name."""
    _refuse_tensor_parallel(slots)
    result: dict[str, torch.Tensor] = {}
    handles, _ = _unit_slots(slots)
    for handle in handles:
        if handle.num_shards == 1:
            for index, info in enumerate(handle.layout.params):
                result[info.fqn] = handle.shard_params[index].detach()
            continue
        flat_full = _gather(handle, handle.flat_shard.detach(), SAVE_PURPOSE)
        for info in handle.layout.params:
            whole = flat_full[info.offset : info.end].view(info.shape)
            result[info.fqn] = _to_dtensor(handle, slots.world_comm, whole)
        del flat_full  # one unit at a time
    for slot in slots.slots:
        if slot.handle is None:
            result[slot.fqn] = slot.local.detach()
    return result


def sharded_optim_state(
    slots: ModelSlots, optim: torch.optim.Optimizer
) -> dict[tuple[str, str], torch.Tensor]:
    """Every parameter-shaped optimizer state as a ``DTensor`` chunk (or a whole tensor)."""
    _refuse_tensor_parallel(slots)
    result: dict[tuple[str, str], torch.Tensor] = {}
    handles, by_handle = _unit_slots(slots)
    for slot in slots.slots:
        if slot.handle is None or slot.handle.num_shards == 1:
            for name, value in optim.state.get(slot.local, {}).items():
                if state_kind(slot, name, value) == SHARDED:
                    result[(slot.fqn, name)] = value.detach().clone()
    for handle in handles:
        if handle.num_shards > 1:
            result.update(_unit_optim_state(handle, by_handle[id(handle)], optim, slots))
    return result


def _unit_optim_state(handle, unit_slots: list[ParamSlot], optim, slots: ModelSlots):
    result = {}
    for name, local, holders in unit_state_shards(handle, unit_slots, optim):
        flat_full = _gather(handle, local, SAVE_PURPOSE)
        for slot in holders:
            info = handle.layout.params[slot.index]
            whole = flat_full[info.offset : info.end].view(info.shape)
            result[(slot.fqn, name)] = _to_dtensor(handle, slots.world_comm, whole)
        del flat_full
    return result


# ----------------------------------------------------------------------------- loading
def _is_ours(value: DTensor, handle: FlatParamHandle, world_comm: Communicator) -> bool:
    mesh = unit_mesh(handle, world_comm)
    return (
        value.device_mesh.ndim == mesh.ndim
        and torch.equal(value.device_mesh.mesh, mesh.mesh)
        and tuple(value.placements) == _placements(mesh)
    )


def _whole_tensor(key: str, value: object) -> torch.Tensor:
    """``value`` as a plain tensor: a tensor, or a stand-in that loads itself through
    ``__torch_function__`` (Lightning's lazily loaded checkpoint tensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if hasattr(type(value), "__torch_function__"):
        loaded = torch.detach(value)
        if isinstance(loaded, torch.Tensor):
            return loaded
    raise TypeError(f"state_dict[{key!r}]: expected a tensor, got {type(value).__name__}")


def local_pieces(
    slots: ModelSlots, items: Iterable[tuple[ParamSlot, str, torch.Tensor]]
) -> dict[tuple[str, str], torch.Tensor]:
    """This rank's piece (shaped like ``slot.local``) of each ``(slot, key, value)``.

    ``key`` names the value in errors. Every rank must pass the same slots and keys in
    the same order (they are what every rank loads), since chunks are gathered unit by unit.
    """
    result: dict[tuple[str, str], torch.Tensor] = {}
    chunked: dict[int, list[tuple[ParamSlot, str, torch.Tensor]]] = {}
    for slot, key, value in items:
        if (
            isinstance(value, DTensor)
            and slot.tp is None
            and _is_chunked(slot.handle, slot.shape)
            and _is_ours(value, slot.handle, slots.world_comm)
        ):
            _check_shape(key, tuple(value.shape), slot.shape)
            chunked.setdefault(id(slot.handle), []).append((slot, key, value))
            continue
        whole = value.full_tensor() if isinstance(value, DTensor) else _whole_tensor(key, value)
        _check_shape(key, tuple(whole.shape), slot.shape)
        result[(slot.fqn, key)] = slot.piece_of_whole(whole).reshape(slot.local.shape)
    for entries in chunked.values():
        result.update(_gathered_pieces(entries))
    return result


def _gathered_pieces(entries: list[tuple[ParamSlot, str, DTensor]]) -> dict:
    """One all-gather per dtype of every rank's (padded) chunks of one unit's tensors."""
    handle = entries[0][0].handle
    result = {}
    for dtype in sorted({e[2].dtype for e in entries}, key=str):
        group = [e for e in entries if e[2].dtype is dtype]
        sizes = []
        for slot, _, _ in group:
            _, _, full_rows = chunk_rows(slot.shape[0], handle.num_shards, 0)
            sizes.append(full_rows * math.prod(slot.shape[1:]))
        local = torch.zeros(sum(sizes), dtype=dtype, device=handle.compute_device)
        offset = 0
        for (_, _, value), size in zip(group, sizes, strict=True):
            chunk = value.to_local().reshape(-1)
            local[offset : offset + chunk.numel()] = chunk.to(local.device)
            offset += size
        gathered = torch.empty(handle.num_shards * local.numel(), dtype=dtype, device=local.device)
        handle.shard_comm.all_gather(
            gathered, local, purpose=LOAD_PURPOSE, unit=handle.comm_label
        ).wait()
        by_rank = gathered.view(handle.num_shards, -1)
        offset = 0
        for (slot, key, _), size in zip(group, sizes, strict=True):
            whole = by_rank[:, offset : offset + size].reshape(-1)[: slot.numel]
            piece = whole[slot.start : slot.end].clone()
            result[(slot.fqn, key)] = piece.reshape(slot.local.shape)
            offset += size
    return result


def _check_shape(name: str, given: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if given != expected:
        raise ValueError(f"state_dict[{name!r}]: shape {given}, the model expects {expected}")
