"""Loading Hugging Face-layout safetensors weights into a sharded model.

A path is a ``.safetensors`` file, or a folder with ``model.safetensors`` or with
``model.safetensors.index.json`` and the files it names. Each rank reads only the rows
that hold its range of each parameter (safetensors slices are memory-mapped), so no rank
ever materialises a whole unsharded model.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from safetensors import safe_open

from .consolidate import HF_INDEX_FILE, HF_SINGLE_FILE
from .format import CheckpointError, member_path
from .fragments import every_name, names_held_elsewhere
from .outcome import guarded, settle
from .slots import ParamSlot, model_slots


def weight_files(path: str) -> dict[str, str]:
    """``{tensor name: file path}`` of a Hugging Face-layout file or folder."""
    if os.path.isfile(path):
        with safe_open(path, framework="pt") as handle:
            return {key: path for key in handle.keys()}
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_pretrained: {path} is neither a file nor a folder")
    index_path = os.path.join(path, HF_INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: no 'weight_map' object")
        return {name: member_path(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, HF_SINGLE_FILE)
    if os.path.exists(single):
        return weight_files(single)
    raise FileNotFoundError(
        f"load_pretrained: {path} has neither {HF_SINGLE_FILE} nor {HF_INDEX_FILE}"
    )


def load_pretrained(model: Any, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Load weights saved in Hugging Face layout into ``model``; call on every rank.

    Tensors are cast to the parameters' dtype. With ``strict``, names present on only
    one side are an error.
    """
    root = os.fspath(path)
    slots = model_slots(model)
    # Other pipeline stages' names ([Note: checkpoints of pipeline stages]).
    elsewhere = names_held_elsewhere(slots, [every_name(slots)])
    outcome = guarded(lambda: _load(root, slots, strict, elsewhere))
    settle(slots.world_comm, "load_pretrained", root, outcome.error, purpose="load_pretrained")


def _load(root: str, slots, strict: bool, elsewhere: set[str]) -> None:
    files = weight_files(root)
    names_of = {s.fqn: [s.fqn] for s in slots.slots}
    for alias, canonical in slots.aliases.items():
        names_of[canonical].append(alias)
    missing = [s.fqn for s in slots.slots if not any(n in files for n in names_of[s.fqn])]
    missing += [n for n in slots.buffers if n not in files]
    known = {n for names in names_of.values() for n in names} | set(slots.buffers)
    unexpected = sorted(set(files) - known - elsewhere)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{root} does not fit the model: missing {missing[:10]}, unexpected "
            f"{unexpected[:10]} (pass strict=False to skip them)"
        )
    handles: dict[str, Any] = {}
    with torch.no_grad():
        for slot in slots.slots:
            name = next((n for n in names_of[slot.fqn] if n in files), None)
            if name is not None and slot.end > slot.start:
                handle = handles.setdefault(files[name], safe_open(files[name], framework="pt"))
                slot.local_flat().copy_(_read_range(handle, name, slot))
        for name, buffer in slots.buffers.items():
            if name in files:
                handle = handles.setdefault(files[name], safe_open(files[name], framework="pt"))
                buffer.copy_(_checked(name, handle.get_tensor(name), tuple(buffer.shape)))


def _checked(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"tensor {name!r}: file shape {tuple(tensor.shape)}, model {shape}")
    return tensor


def _read_range(handle, name: str, slot: ParamSlot) -> torch.Tensor:
    """This rank's elements of ``name`` (``slot.local_flat()``'s), reading whole rows only."""
    view = handle.get_slice(name)
    shape = tuple(view.get_shape())
    if shape != slot.shape:
        raise CheckpointError(f"parameter {name!r}: file shape {shape}, model shape {slot.shape}")
    if len(shape) == 0:
        return handle.get_tensor(name).reshape(-1).to(slot.dtype)
    # A tensor-parallel block is several ranges of the global tensor; others are one.
    return slot.read_local(lambda s, e: _global_range(view, shape, s, e)).to(slot.dtype)


def _global_range(view, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of a stored tensor flattened."""
    row = math.prod(shape[1:])
    first_row, last_row = start // row, -(-end // row)
    rows = view[first_row:last_row].reshape(-1)
    begin = start - first_row * row
    return rows[begin : begin + end - start]
