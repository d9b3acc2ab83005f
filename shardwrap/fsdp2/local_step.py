"""The FSDP2 door's optimizer steps on the local shards of its DTensor parameters.

[Note: stepping the local shards]
FSDP2's parameters are DTensors, so a torch optimizer's every op on them goes through
DTensor's dispatch: per parameter and step about ten ops (AdamW), each resolving its
sharding in Python; at 5m (71 parameters, 2 ranks) that doubled the step of the optimizer
(12 ms against 6 over plain tensors: benchmarks/RESULTS.md). Adam and AdamW are
elementwise: on a ``Shard(0)`` DTensor each op is the same op on the local tensor, bit for
bit. So while such an optimizer steps parameters that are all the door's (or plain
tensors), the step sees their local shards instead: its param groups hold plain views
of the local tensors, with the local gradients, and its state for them the local tensors
of the DTensor state, which the step updates in place. Everything is put back before any
other after-step action runs (``core/optimizer_step.py``), so the optimizer, its state
dict and its state are FSDP2's between steps.

Only where nothing else could differ: exactly ``torch.optim.Adam`` or ``AdamW`` (not a
subclass, whose step may not be elementwise), no closure, not ``differentiable`` nor
``capturable``, every parameter's gradient of its own placements, and state already made
(the first step makes it as DTensors, through DTensor, as FSDP2's does). A step that
raises leaves the swap in place; the next step, ``state_dict()`` or ``load_state_dict()``
puts it back first. A step pre-hook registered after the first step sees the local views.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from ..ckpt.slots import shaped_like
from ..core import optimizer_step

_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW)
# Marks a door parameter (an attribute: a WeakSet of tensors would compare them with ==).
_DOOR_PARAM = "_shardwrap_steps_locally"


def register(param: torch.nn.Parameter) -> None:
    """``param``, a door parameter (a DTensor over its unit's shard), may be stepped locally."""
    setattr(param, _DOOR_PARAM, True)
    optimizer_step.set_step_views(enter, leave)


def _is_door_param(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _DOOR_PARAM, False)


@dataclass
class _Swap:
    """What :func:`enter` replaced: each group's parameter list, and per local view its
    parameter and the state dict handed to the step."""

    params: list[list[torch.Tensor]]
    locals: list[tuple[torch.Tensor, torch.Tensor, dict]] = field(default_factory=list)


_SWAPS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Swap] = weakref.WeakKeyDictionary()
_HOOKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _eligible(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    """``args``/``kwargs``: the step's, as its hooks get them (the optimizer first)."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if type(optimizer) not in _ELEMENTWISE or closure is not None:
        return False
    found = False
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable"):
            return False
        for p in group["params"]:
            if not _is_door_param(p):
                if isinstance(p, DTensor):
                    return False
                continue
            found = True
            if p.grad is None:
                continue
            state = optimizer.state.get(p)
            if not state or not _same_spec(p.grad, p):
                return False
            if any(isinstance(v, DTensor) and not _same_spec(v, p) for v in state.values()):
                return False
    return found


def _same_spec(tensor: torch.Tensor, param: torch.Tensor) -> bool:
    return (
        isinstance(tensor, DTensor)
        and tensor.placements == param.placements
        and tensor.device_mesh == param.device_mesh
    )


def enter(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Before ``optimizer`` steps: show it the local shards where that is exact."""
    leave(optimizer)
    if not _eligible(optimizer, args, kwargs):
        return
    swap = _Swap([group["params"] for group in optimizer.param_groups])
    for group in optimizer.param_groups:
        shown = []
        for p in group["params"]:
            if not _is_door_param(p):
                shown.append(p)
                continue
            local = p._local_tensor.detach()
            if p.grad is not None:
                local.grad = p.grad._local_tensor
            handed = {
                k: v._local_tensor if isinstance(v, DTensor) else v
                for k, v in optimizer.state.get(p, {}).items()
            }
            if handed:
                optimizer.state[local] = handed
            swap.locals.append((local, p, dict(handed)))
            shown.append(local)
        group["params"] = shown
    _SWAPS[optimizer] = swap
    if optimizer not in _HOOKED:  # a step that raised must not leak the views
        _HOOKED.add(optimizer)
        optimizer.register_state_dict_pre_hook(leave)
        optimizer.register_load_state_dict_pre_hook(lambda opt, _state: leave(opt))


def leave(optimizer: torch.optim.Optimizer, *_: object) -> None:
    """Put back what :func:`enter` replaced (a no-op when nothing is swapped)."""
    swap = _SWAPS.pop(optimizer, None)
    if swap is None:
        return
    for group, params in zip(optimizer.param_groups, swap.params, strict=True):
        group["params"] = params
    for local, param, handed in swap.locals:
        stepped = optimizer.state.pop(local, {})
        state = optimizer.state[param]
        for key, value in stepped.items():
            if value is not handed.get(key):  # made or replaced by the step: keep it
                state[key] = _as_param_like(value, local, param)
        local.grad = None


def _as_param_like(value: object, local: torch.Tensor, param: torch.Tensor) -> object:
    """A state value made by a local step, as the DTensor step would have made it."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape == local.shape:
        return shaped_like(param, value)
    return value
