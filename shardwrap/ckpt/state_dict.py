"""FSDP-compatible state dicts of a ``ShardedModule`` and of its optimizer.

Under ``FULL_STATE_DICT`` (the default, as in FSDP1) ``model.state_dict()`` has exactly the
unwrapped model's keys, tied names included, holding whole tensors. It is built unit by
unit: one unit's flat parameter is gathered, its parameters are copied out and the
gathered buffer is dropped before the next unit, so peak memory is the result plus one
unit. ``load_state_dict`` takes such a dict on every rank and keeps each rank's range.

Optimizer state dicts follow FSDP's ``optim_state_dict`` form: keyed by parameter name,
``{"state": {name: {state: value}}, "param_groups": [{..., "params": [names]}]}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ..assemble.root import holders_in
from ..flat_param import FlatParamHandle
from ..fsdp1_options import parse_state_dict_type
from ..options import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from . import dtensor_state
from .optim_state import (
    SHARDED,
    build_load_dict,
    hyperparameters,
    optimizer_slots,
    unit_state_shards,
)
from .optim_state import state_kind as _state_kind
from .slots import ModelSlots, ParamSlot, model_slots


@dataclass(frozen=True)
class StateDictSettings:
    """The state-dict type of a root and its config."""

    state_dict_type: StateDictType
    state_dict_config: FullStateDictConfig | ShardedStateDictConfig


_DEFAULT = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig())
_SETTINGS: weakref.WeakKeyDictionary[nn.Module, StateDictSettings] = weakref.WeakKeyDictionary()


def set_state_dict_type(
    module: nn.Module, state_dict_type: Any, state_dict_config: Any = None
) -> StateDictSettings:
    """Set what ``module.state_dict()`` returns; returns the previous settings."""
    kind = parse_state_dict_type(state_dict_type)  # refuses LOCAL_STATE_DICT
    expected = (
        FullStateDictConfig if kind is StateDictType.FULL_STATE_DICT else ShardedStateDictConfig
    )
    config = _as_config(expected, kind, state_dict_config)
    previous = get_state_dict_type(module)
    for root in _roots(module):
        _SETTINGS[root] = StateDictSettings(kind, config)
    return previous


def _as_config(expected: type, kind: StateDictType, config: Any):
    """Our config record; torch's record of the same name is converted field by field."""
    if config is None:
        return expected()
    if isinstance(config, expected):
        return config
    if type(config).__name__ == expected.__name__:
        return expected(**{f.name: getattr(config, f.name) for f in dataclasses.fields(expected)})
    raise TypeError(
        f"state_dict_config: {kind.name} takes {expected.__name__}, got {type(config).__name__}"
    )


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    roots = _roots(module)
    return _SETTINGS.get(roots[0], _DEFAULT) if roots else _DEFAULT


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module, state_dict_type: Any, state_dict_config: Any = None
) -> Iterator[None]:
    """Use ``state_dict_type`` for ``module``'s state dicts inside the context."""
    previous = set_state_dict_type(module, state_dict_type, state_dict_config)
    try:
        yield
    finally:
        for root in _roots(module):
            _SETTINGS[root] = previous


def _roots(module: nn.Module) -> list[nn.Module]:
    return holders_in(module)


# ------------------------------------------------------------------ model state dicts
def module_state_dict(model: nn.Module, *, destination=None, prefix: str = "") -> dict:
    """``model.state_dict()`` under the model's current state-dict type."""
    settings = get_state_dict_type(model)
    slots = model_slots(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    skip = full and settings.state_dict_config.rank0_only and slots.world_comm.rank != 0
    if full:
        values = _full_params(slots, keep=not skip)
    else:
        values = dtensor_state.sharded_params(slots)  # [Note: DTensor state dicts]
    result = {} if destination is None else destination
    if skip:
        return result
    used: set[str] = set()
    for name, tensor in model.module.state_dict(keep_vars=True).items():
        slot = slots.by_param.get(id(tensor))
        value = values[slot.fqn] if slot is not None else tensor.detach()
        # Whole tensors are each key's own, tied names included, as FSDP1 gives them: savers
        # such as safetensors refuse tensors that share memory.
        if full and (slot is None or slot.fqn in used):
            value = value.clone()
        if slot is not None:
            used.add(slot.fqn)
        if settings.state_dict_config.offload_to_cpu:
            value = value.cpu()
        result[prefix + name] = value
    return result


def gather_flat(handle: FlatParamHandle, local_flat: torch.Tensor, purpose: str) -> torch.Tensor:
    """All-gather a shard-sized 1-D tensor of ``handle`` into its padded full size."""
    if handle.num_shards == 1:
        return local_flat
    local_flat = local_flat.to(handle.compute_device)  # host shards (CPUOffload) gather there
    full = torch.empty(handle.layout.padded_numel, dtype=local_flat.dtype, device=local_flat.device)
    handle.shard_comm.all_gather(full, local_flat, purpose=purpose).wait()
    return full


def _full_params(slots: ModelSlots, *, keep: bool) -> dict[str, torch.Tensor]:
    """Whole parameters, one unit gathered at a time (``keep=False``: only take part)."""
    result: dict[str, torch.Tensor] = {}
    for handle in _handles(slots):
        flat_full = gather_flat(handle, handle.flat_shard.detach(), "state_dict")
        result.update(_whole_params(handle, flat_full, keep, "state_dict"))
        del flat_full  # one unit at a time
    for slot in slots.slots:
        if slot.handle is None:
            result[slot.fqn] = slot.local.detach().clone()
    return result


def _whole_params(
    handle: FlatParamHandle, flat_full: torch.Tensor, keep: bool, purpose: str
) -> dict[str, torch.Tensor]:
    """Each parameter of ``flat_full`` (``handle``'s layout) as a whole global tensor;
    tensor-parallel blocks are gathered over their mesh, by every rank (``keep=False``:
    only take part)."""
    result = {}
    for info, spec in zip(handle.layout.params, handle.tp_specs, strict=True):
        if spec is None and not keep:
            continue
        value = flat_full[info.offset : info.end].view(info.shape)
        if spec is not None:
            value = spec.global_of(value, handle.shard_comm.ledger, purpose)
        if keep:
            result[info.fqn] = value.clone()
    return result


def _handles(slots: ModelSlots) -> list[FlatParamHandle]:
    seen: dict[int, FlatParamHandle] = {}
    for slot in slots.slots:
        if slot.handle is not None:
            seen.setdefault(id(slot.handle), slot.handle)
    return list(seen.values())


def load_module_state_dict(model: nn.Module, state_dict: dict, strict: bool = True):
    """``model.load_state_dict``: whole tensors or DTensors, under either state-dict type."""
    slots = model_slots(model)
    expected = list(model.module.state_dict(keep_vars=True))
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(expected)]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(model.module).__name__}: missing "
            f"key(s) {missing}, unexpected key(s) {unexpected}"
        )
    names_of: dict[str, list[str]] = {s.fqn: [s.fqn] for s in slots.slots}
    for alias, canonical in slots.aliases.items():
        names_of[canonical].append(alias)
    keys = {s.fqn: next((k for k in names_of[s.fqn] if k in state_dict), None) for s in slots.slots}
    items = [(s, keys[s.fqn], state_dict[keys[s.fqn]]) for s in slots.slots if keys[s.fqn]]
    pieces = dtensor_state.local_pieces(slots, items)  # whole tensors or DTensors, any type
    with torch.no_grad():
        for slot, key, _ in items:
            _load_param(slot, key, pieces[(slot.fqn, key)])
        for name, buffer in slots.buffers.items():
            if name in state_dict:
                _check_shape(name, tuple(state_dict[name].shape), tuple(buffer.shape))
                buffer.copy_(state_dict[name])
    return _IncompatibleKeys(missing, unexpected)


def _load_param(slot: ParamSlot, key: str, piece: torch.Tensor) -> None:
    _check_shape(key, tuple(piece.shape), tuple(slot.local.shape))
    slot.local.copy_(piece)


def _check_shape(name: str, given: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if given != expected:
        raise ValueError(f"state_dict[{name!r}]: shape {given}, the model expects {expected}")


# -------------------------------------------------------------- optimizer state dicts
def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (whole tensors under FULL_STATE_DICT)."""
    settings = get_state_dict_type(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    slots = model_slots(model)
    groups = optimizer_slots(optim, slots)
    sharded = (
        _gather_sharded_state(slots, optim)
        if full
        else dtensor_state.sharded_optim_state(slots, optim)
    )
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for index, (group, group_slots) in enumerate(zip(optim.param_groups, groups, strict=True)):
        param_groups.append(
            {**hyperparameters(group, index), "params": [s.fqn for s in group_slots]}
        )
        for slot in group_slots:
            for name, value in optim.state.get(slot.local, {}).items():
                kind = _state_kind(slot, name, value)
                entry = state.setdefault(slot.fqn, {})
                entry[name] = sharded[(slot.fqn, name)] if kind == SHARDED else _copy(value)
    if full and settings.state_dict_config.rank0_only and slots.world_comm.rank != 0:
        return {}
    return {"state": state, "param_groups": param_groups}


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _localized(slots: ModelSlots, saved_state: dict[str, dict[str, Any]]) -> dict[str, dict]:
    """Saved state with every parameter-shaped tensor replaced by this rank's piece."""
    by_name = slots.by_name()
    items = [
        (by_name[fqn], f"{fqn}/{name}", value)
        for fqn, entry in saved_state.items()
        if fqn in by_name
        for name, value in entry.items()
        if isinstance(value, torch.Tensor)
        and value.dim() > 0
        and tuple(value.shape) == by_name[fqn].shape
    ]
    pieces = dtensor_state.local_pieces(slots, items)
    result = {fqn: dict(entry) for fqn, entry in saved_state.items()}
    for slot, key, _ in items:
        result[slot.fqn][key.rsplit("/", 1)[1]] = pieces[(slot.fqn, key)]
    return result


def _gather_sharded_state(slots: ModelSlots, optim) -> dict[tuple[str, str], torch.Tensor]:
    """Whole tensors of every sharded state, gathered unit by unit and name by name."""
    result: dict[tuple[str, str], torch.Tensor] = {}
    by_handle: dict[int, list[ParamSlot]] = {}
    for slot in slots.slots:
        if slot.handle is not None:
            by_handle.setdefault(id(slot.handle), []).append(slot)
        else:
            for name, value in optim.state.get(slot.local, {}).items():
                if _state_kind(slot, name, value) == SHARDED:
                    result[(slot.fqn, name)] = value.detach().clone()
    for handle in _handles(slots):
        result.update(_gather_unit_state(handle, by_handle[id(handle)], optim))
    return result


def _gather_unit_state(handle: FlatParamHandle, unit_slots: list[ParamSlot], optim):
    result = {}
    for name, local, holders in unit_state_shards(handle, unit_slots, optim):
        flat_full = gather_flat(handle, local, "optim_state_dict")
        whole = _whole_params(handle, flat_full, True, "optim_state_dict")
        for slot in holders:
            result[(slot.fqn, name)] = whole[slot.fqn]
    return result


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    *,
    load_directly: bool = False,
) -> dict[str, Any]:
    """Turn a name-keyed optimizer state dict (whole tensors or DTensors, under either
    state-dict type) into ``optim.load_state_dict``'s argument."""
    slots = model_slots(model)
    saved_state = {slots.aliases.get(k, k): v for k, v in optim_state_dict["state"].items()}
    saved_groups = [
        {**g, "params": [slots.aliases.get(n, n) for n in g["params"]]}
        for g in optim_state_dict["param_groups"]
    ]
    saved_state = _localized(slots, saved_state)  # [Note: DTensor state dicts]

    def read(slot: ParamSlot, name: str) -> Any:
        value = saved_state[slot.fqn][name]
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() == 0 and not (slot.local.dim() == 0 and name != "step"):
            return value.clone()
        _check_shape(f"{slot.fqn}/{name}", tuple(value.shape), tuple(slot.local.shape))
        return value.clone()

    names = {k: list(v) for k, v in saved_state.items()}
    result = build_load_dict(optim, optimizer_slots(optim, slots), saved_groups, names, read)
    if load_directly:
        optim.load_state_dict(result)
    return result


__all__ = [
    "StateDictSettings",
    "get_state_dict_type",
    "load_module_state_dict",
    "module_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "set_state_dict_type",
    "state_dict_type",
]
