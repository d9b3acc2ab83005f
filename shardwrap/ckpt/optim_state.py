"""Optimizer state of shard parameters, by original parameter name.

An optimizer over a ``ShardedModule`` holds this rank's pieces (see ``ckpt/slots.py``). Its
per-parameter state falls in three kinds:

* *sharded*: a tensor shaped like the piece (Adam's ``exp_avg``, SGD's momentum): it is
  the same element range of a tensor shaped like the original parameter;
* *scalar*: a 0-dim tensor (Adam's ``step``), equal on every rank;
* *value*: a plain JSON number or flag.

Anything else (a factored second moment, say) cannot be resharded and is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from ..core.tensor_parallel import local_tensor
from .slots import ModelSlots, ParamSlot

SHARDED, SCALAR, VALUE = "sharded", "scalar", "value"


def state_kind(slot: ParamSlot, name: str, value: Any) -> str:
    """How state ``name`` of ``slot``'s parameter is stored (or a ``TypeError``)."""
    if isinstance(value, torch.Tensor):
        if value.shape == slot.local.shape and not (value.dim() == 0 and name == "step"):
            return SHARDED
        if value.dim() == 0:
            return SCALAR
        raise TypeError(
            f"optimizer state {name!r} of parameter {slot.fqn!r} has shape "
            f"{tuple(value.shape)}, neither the local piece's {tuple(slot.local.shape)} nor a "
            "scalar; shardwrap cannot reshard it"
        )
    if value is None or isinstance(value, bool | int | float | str):
        return VALUE
    raise TypeError(
        f"optimizer state {name!r} of parameter {slot.fqn!r} is a {type(value).__name__}; "
        "only tensors and JSON scalars can be saved"
    )


def optimizer_slots(optimizer: torch.optim.Optimizer, slots: ModelSlots) -> list[list[ParamSlot]]:
    """The slot of every optimizer parameter, group by group."""
    groups = []
    for group_index, group in enumerate(optimizer.param_groups):
        found = []
        for param in group["params"]:
            slot = slots.by_param.get(id(param))
            if slot is None:
                raise ValueError(
                    f"optimizer: param_groups[{group_index}] holds a tensor of shape "
                    f"{tuple(param.shape)} that is not a parameter of the model; build the "
                    "optimizer from the ShardedModule's parameters"
                )
            found.append(slot)
        groups.append(found)
    return groups


def hyperparameters(group: dict[str, Any], group_index: int) -> dict[str, Any]:
    """A parameter group's settings as JSON values (tuples become lists)."""
    settings = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = value.item()
        value = list(value) if isinstance(value, tuple) else value
        try:
            json.dumps(value)
        except TypeError as exc:
            raise TypeError(
                f"optimizer: param_groups[{group_index}][{key!r}] = {value!r} is not JSON"
            ) from exc
        settings[key] = value
    return settings


def restore_settings(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """Saved settings in the types the live group uses (lists back to tuples)."""
    restored = {}
    for key, value in saved.items():
        if key == "params":
            continue
        now = current.get(key)
        if isinstance(now, tuple) and isinstance(value, list):
            value = tuple(value)
        elif isinstance(now, torch.Tensor) and not isinstance(value, torch.Tensor):
            value = torch.tensor(value, dtype=now.dtype, device=now.device)
        restored[key] = value
    return restored


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_fits(
    optimizer: torch.optim.Optimizer,
    groups_slots: list[list[ParamSlot]],
    saved_class: str | None,
    saved_groups: list[dict[str, Any]],
) -> None:
    """Refuse saved state that does not fit ``optimizer`` (call before changing anything).

    The class must be the saved one (checkpoints that predate the record skip this), the
    groups the same parameters, and every saved group must hold each setting the optimizer
    defines (``optimizer.defaults``): its ``step`` reads them.
    """
    current = optimizer_class_name(optimizer)
    if saved_class is not None and saved_class != current:
        raise ValueError(
            f"optimizer: the checkpoint holds the state of a {saved_class}, this optimizer is "
            f"a {current}; build a {saved_class} to load it (or load without the optimizer)"
        )
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"optimizer: the saved state has {len(saved_groups)} param groups, this optimizer "
            f"has {len(optimizer.param_groups)}"
        )
    for i, (group, slots, saved) in enumerate(
        zip(optimizer.param_groups, groups_slots, saved_groups, strict=True)
    ):
        names = sorted(s.fqn for s in slots)
        if names != sorted(saved["params"]):
            raise ValueError(
                f"optimizer: param_groups[{i}] holds {names}, the saved group holds "
                f"{sorted(saved['params'])}"
            )
        missing = sorted(k for k in group if k in optimizer.defaults and k not in saved)
        if missing:
            raise ValueError(
                f"optimizer: the saved param_groups[{i}] lacks the settings {missing} of this "
                f"{current} (saved from another optimizer class?); its keys: "
                f"{sorted(k for k in saved if k != 'params')}"
            )


StateReader = Callable[[ParamSlot, str], Any]  # (slot, state name) -> local value


def build_load_dict(
    optimizer: torch.optim.Optimizer,
    groups_slots: list[list[ParamSlot]],
    saved_groups: list[dict[str, Any]],
    saved_state_names: dict[str, list[str]],
    read: StateReader,
) -> dict[str, Any]:
    """An ``optimizer.load_state_dict`` argument for this rank's pieces.

    ``saved_groups`` have ``"params"`` as lists of names; ``saved_state_names`` lists the
    state names saved per parameter name; ``read`` produces one local value.
    """
    check_fits(optimizer, groups_slots, None, saved_groups)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    position = 0
    for group, slots, saved in zip(optimizer.param_groups, groups_slots, saved_groups, strict=True):
        ids = list(range(position, position + len(slots)))
        position += len(slots)
        for param_id, slot in zip(ids, slots, strict=True):
            wanted = saved_state_names.get(slot.fqn, [])
            if wanted:
                state[param_id] = {name: read(slot, name) for name in wanted}
        groups.append({**restore_settings(saved, group), "params": ids})
    return {"state": state, "param_groups": groups}


def unit_state_shards(
    handle: Any, unit_slots: list[ParamSlot], optim: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor, list[ParamSlot]]]:
    """Each sharded optimizer state of one unit (``exp_avg``, ...), as this rank's shard laid
    out like the unit's flat shard (zeros where no parameter has it), with the slots that
    hold it. Every rank holds state for the same parameters (the gradient presence vote),
    so the shards line up for a gather.
    """
    dtypes: dict[str, torch.dtype] = {}
    for slot in unit_slots:
        for name, value in optim.state.get(slot.local, {}).items():
            if state_kind(slot, name, value) == SHARDED:
                dtypes.setdefault(name, value.dtype)
    result = []
    for name in sorted(dtypes):
        local = torch.zeros(handle.layout.shard_numel, dtype=dtypes[name])
        holders = []
        for slot in unit_slots:
            value = optim.state.get(slot.local, {}).get(name)
            if value is None:
                continue
            holders.append(slot)
            if handle.num_shards == 1:
                start = handle.layout.params[slot.index].offset
            else:
                start = handle.pieces[slot.index].shard_start
            flat = local_tensor(value).detach().reshape(-1)
            local[start : start + flat.numel()] = flat
        result.append((name, local, holders))
    return result
