"""FSDP1's ``rekey_optim_state_dict``: optimizer state keyed by parameter name or ID.

IDs are positions in the optimizer's parameters (group after group), as an unwrapped
model's optimizer keys its state; names are the unwrapped model's parameter names.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..assemble.root import is_root
from ..fsdp1_options import OptimStateKeyType
from .slots import model_slots


def rekey_optim_state_dict(
    optim_state_dict: dict,
    optim_state_key_type: Any,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Key ``optim_state_dict`` by parameter name or by parameter ID.

    IDs are positions in ``optim``'s parameters (group after group), else in
    ``optim_input``, else in ``model.parameters()``; names are ``model``'s (the unwrapped
    model's names when ``model`` is a ``ShardedModule``).
    """
    key_type = OptimStateKeyType.parse(optim_state_key_type)
    keys = list(optim_state_dict["state"])
    if not all(isinstance(k, str) for k in keys) and not all(isinstance(k, int) for k in keys):
        raise ValueError(f"optim_state_dict: mixed parameter keys {keys}")
    names = _id_to_name(model, optim, optim_input)
    if key_type is OptimStateKeyType.PARAM_NAME:
        mapping: dict[Any, Any] = dict(enumerate(names))
    else:
        mapping = {name: i for i, name in enumerate(names)}
    result = copy.copy(optim_state_dict)
    if not _all_keyed_for(optim_state_dict, key_type):
        result["state"] = {_mapped(mapping, k): v for k, v in optim_state_dict["state"].items()}
        result["param_groups"] = [
            {**g, "params": sorted(_mapped(mapping, k) for k in g["params"])}
            for g in optim_state_dict["param_groups"]
        ]
    return result


def _all_keyed_for(osd: dict, key_type: OptimStateKeyType) -> bool:
    wanted = str if key_type is OptimStateKeyType.PARAM_NAME else int
    keys = [*osd["state"], *(k for g in osd["param_groups"] for k in g["params"])]
    return all(isinstance(k, wanted) for k in keys)


def _mapped(mapping: dict, key: Any) -> Any:
    if key not in mapping:
        raise ValueError(f"optim_state_dict: parameter key {key!r} has no counterpart in the model")
    return mapping[key]


def _id_to_name(model: nn.Module, optim, optim_input) -> list[str]:
    """Parameter names in parameter-ID order."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    if is_root(model):  # a ShardedModule
        name_of.update({k: s.fqn for k, s in model_slots(model).by_param.items()})
    if optim is not None:
        params = [p for g in optim.param_groups for p in g["params"]]
    elif optim_input is not None:
        items = list(optim_input)
        params = (
            [p for g in items for p in g["params"]]
            if items and isinstance(items[0], dict)
            else items
        )
    else:
        return [n for n, _ in model.named_parameters()]
    unknown = [tuple(p.shape) for p in params if id(p) not in name_of]
    if unknown:
        raise ValueError(f"optim: parameters of shapes {unknown} are not parameters of model")
    return [name_of[id(p)] for p in params]


def names_keyed(osd: Any, model: nn.Module, optim_input: Any = None) -> Any:
    """``osd`` keyed by parameter name; an ID-keyed one (IDs in ``optim_input`` or
    ``model.parameters()`` order, as an unwrapped model's optimizer keys it) is rekeyed."""
    if (
        isinstance(osd, dict)
        and "state" in osd
        and not _all_keyed_for(osd, OptimStateKeyType.PARAM_NAME)
    ):
        return rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model, optim_input)
    return osd
