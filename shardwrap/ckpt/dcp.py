"""``get_state_dict``/``set_state_dict`` for a ``ShardedModule``, as
``torch.distributed.checkpoint.state_dict`` has them (same arguments, same result form).

torch's own functions recognise only torch's FSDP classes. On any other module they call
``model.state_dict()`` and key ``optim.state_dict()`` by ``named_parameters()`` names,
which for a ``ShardedModule`` are this rank's flat pieces under the whole parameter's
name: a checkpoint that silently keeps one rank's piece. These functions give what torch
gives for FSDP: with ``StateDictOptions()`` (the default) ``DTensor`` values that
``torch.distributed.checkpoint`` reshards ([Note: DTensor state dicts]); with
``full_state_dict=True`` whole tensors on every rank (``cpu_offload=True`` as well: in
host memory, on rank 0 only, other ranks get empty dicts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from ..options import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from . import state_dict as sd
from .slots import model_slots

_UNSUPPORTED = ("broadcast_from_rank0", "flatten_optimizer_state_dict")


def _optims(optimizers: Any) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def _check_options(options: StateDictOptions | None) -> StateDictOptions:
    options = options or StateDictOptions()
    used = [name for name in _UNSUPPORTED if getattr(options, name, False)]
    if used:
        raise ValueError(f"StateDictOptions: {', '.join(used)} is not supported by shardwrap")
    return options


def _settings(options: StateDictOptions) -> tuple[StateDictType, Any]:
    if options.full_state_dict:
        config = FullStateDictConfig(
            offload_to_cpu=options.cpu_offload, rank0_only=options.cpu_offload
        )
        return StateDictType.FULL_STATE_DICT, config
    return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(
        offload_to_cpu=options.cpu_offload
    )


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Create an empty optimizer's state (one step at learning rate 0 on zero gradients),
    so that a state dict of it lists every state tensor a checkpoint fills."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):
        return
    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    saved = [g.get("lr") for g in optim.param_groups]
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step()
    for group, lr in zip(optim.param_groups, saved, strict=True):
        if lr is not None:
            group["lr"] = lr
    optim.zero_grad(set_to_none=True)


def _frozen_names(model: nn.Module) -> set[str]:
    return {
        name
        for name, param in model.named_parameters(remove_duplicate=False)
        if not param.requires_grad
    }


def get_model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None) -> dict:
    return get_state_dict(model, [], options=options)[0]


def get_optimizer_state_dict(
    model: nn.Module, optimizers: Any, *, options: StateDictOptions | None = None
) -> dict:
    return get_state_dict(model, optimizers, options=options)[1]


def get_state_dict(
    model: nn.Module, optimizers: Any, *, options: StateDictOptions | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model state dict, optimizer state dict)`` of a ``ShardedModule``, keyed by the
    unwrapped model's names (see the module docstring for what ``options`` select)."""
    options = _check_options(options)
    kind, config = _settings(options)
    optims = _optims(optimizers)
    with sd.state_dict_type(model, kind, config):
        model_sd = model.state_dict()
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        for optim in optims:
            init_optim_state(optim)
            osd = sd.optim_state_dict(model, optim)
            merged["state"].update(osd.get("state", {}))
            merged["param_groups"].extend(osd.get("param_groups", []))
    if options.ignore_frozen_params:
        frozen = _frozen_names(model)
        model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
    if options.full_state_dict and options.cpu_offload and model_slots(model).world_comm.rank:
        return {}, {}
    return model_sd, merged if optims else {}


def set_state_dict(
    model: nn.Module,
    optimizers: Any,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
):
    """Load what :func:`get_state_dict` (or DCP into its result) produced; values may be
    ``DTensor``s of any layout or whole tensors. Returns the model's missing/unexpected keys.
    """
    result = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return result


def set_model_state_dict(
    model: nn.Module, model_state_dict: dict[str, Any], *, options: StateDictOptions | None = None
):
    """Load a model state dict (``DTensor``s of any layout or whole tensors) into a
    ``ShardedModule``; its missing/unexpected keys, as torch's function returns them."""
    options = _check_options(options)
    strict = options.strict and not options.ignore_frozen_params
    # The sharded path takes both DTensors and whole tensors.
    with sd.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return sd.load_module_state_dict(model, model_state_dict, strict=strict)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Any,
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load an optimizer state dict keyed by the unwrapped model's names (what
    :func:`get_optimizer_state_dict` gives) into the optimizers of a ``ShardedModule``."""
    _check_options(options)
    optims = _optims(optimizers)
    with sd.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        for optim in optims:
            mine = _split(model, optim, optim_state_dict) if len(optims) > 1 else optim_state_dict
            optim.load_state_dict(sd.optim_state_dict_to_load(model, optim, mine))


def _split(model: nn.Module, optim: torch.optim.Optimizer, merged: dict[str, Any]) -> dict:
    """The groups (and state) of ``merged`` that hold ``optim``'s parameters."""
    slots = model_slots(model)
    names = {slots.by_param[id(p)].fqn for g in optim.param_groups for p in g["params"]}
    groups = [g for g in merged["param_groups"] if set(g["params"]) & names]
    return {
        "state": {k: v for k, v in merged["state"].items() if k in names},
        "param_groups": groups,
    }


__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "init_optim_state",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]
