"""Gradient-norm clipping over sharded gradients.

[Note: which ranks a norm is summed over]
After reduction every rank holds, for each unit, its shard of the *averaged* gradient
(NO_SHARD: the whole averaged gradient). Ranks of one shard group hold disjoint pieces, so
their partial sums add up to the full norm; replica groups (NO_SHARD, hybrid) hold copies
of the same pieces, so summing across them would count each piece several times. The
partial norms are therefore combined over each unit's shard group only. Parameters the
wrapper does not manage (ignored modules) are replicated and added locally.

Under tensor parallelism a shard holds a piece of one TP rank's block: blocks of a
TP-sharded parameter differ across the TP mesh dims that shard it, so their partial sums
are also combined over those dims; replicated parameters (plain ones, ``Replicate``
DTensors) are alike on every TP rank and counted once, from the data-parallel sum alone.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..base.pages import release_resident

if TYPE_CHECKING:
    from ..runtime.step import StepRuntime

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing; so do we, so that
# both clip by exactly the same factor.
_CLIP_EPS = 1e-6
# Elements of a gradient whose norm is taken at once (float64 copies of 32 MiB at most).
NORM_PIECE = 1 << 22


def _check_norm_type(norm_type: float) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type: expected a number or math.inf, got {norm_type!r}")
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"norm_type: must be positive or math.inf, got {norm_type}")
    return norm_type


def _partial(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """max |g| for inf, else sum |g|^p, in float32 (or wider), over ``grads``."""
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        # In pieces, so the float64 copies stay small next to a large (disk-offloaded) shard
        # (a tensor subclass, a DTensor, whole).
        plain = type(grad) is torch.Tensor
        for piece in grad.detach().reshape(-1).split(NORM_PIECE) if plain else [grad.detach()]:
            values = piece.to(torch.float64).abs()
            if norm_type == math.inf:
                total = torch.maximum(total, values.max() if values.numel() else total)
            else:
                total = total + values.pow(norm_type).sum()
        release_resident(grad)  # DiskOffload: [Note: releasing mapped pages where they are touched]
    return total


def sharded_grad_norm(
    runtime: StepRuntime, parameters: Iterable[torch.Tensor], norm_type: float
) -> tuple[torch.Tensor, list]:
    """Total ``norm_type`` norm of the full gradients, and the local gradient tensors.

    ``runtime``: the root's; ``parameters``: all of the root's (those of ignored modules
    included).
    """
    runtime.reduce_deferred_grads()  # ZeRO-1 grads that no_sync backwards left local
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    by_comms: dict[tuple[int, ...], tuple] = {}
    managed: set[int] = set()
    all_grads: list[torch.Tensor] = []
    for unit in runtime.units:
        if unit.handle is None:
            continue
        handle = unit.handle
        managed.update(id(p) for p in handle.shard_params)
        for param, tp_comms in zip(handle.shard_params, handle.tp_norm_comms, strict=True):
            if param.grad is None:
                continue
            # [Note: which ranks a norm is summed over]; TP-sharded blocks over TP too.
            comms = (handle.shard_comm, *tp_comms)
            entry = by_comms.setdefault(tuple(id(c) for c in comms), (comms, []))
            entry[1].append(param.grad)
            all_grads.append(param.grad)
    total = torch.zeros((), dtype=torch.float64)
    for comms, grads in by_comms.values():
        partial = _partial(grads, norm_type)
        for comm in comms:
            comm.all_reduce(partial, purpose="grad_norm", op=op).wait()
        total = torch.maximum(total, partial) if norm_type == math.inf else total + partial
    unmanaged = [p.grad for p in parameters if id(p) not in managed and p.grad is not None]
    all_grads.extend(unmanaged)
    local = _partial(unmanaged, norm_type)
    total = torch.maximum(total, local) if norm_type == math.inf else total + local
    if norm_type != math.inf:
        total = total.pow(1.0 / norm_type)
    return total, all_grads


def clip_grad_norm_(
    runtime: StepRuntime,
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scale gradients so their total norm is at most ``max_norm``; return the norm before.

    Equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (every rank gets the
    same value and the same factor). Call it after backward and before ``optimizer.step()``.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"max_norm: expected a number, got {max_norm!r}")
    norm_type = _check_norm_type(norm_type)
    total, grads = sharded_grad_norm(runtime, parameters, norm_type)
    dtype = grads[0].dtype if grads else torch.float32
    if not grads:  # as torch's FSDP: warn, and return the (all-rank) norm in float32
        rank = runtime.world_comm.rank
        warnings.warn(
            f"Called clip_grad_norm_() on rank {rank} with no gradients -- returning the "
            f"total norm in the default dtype {dtype}",
            stacklevel=3,
        )
    clip_coef = (float(max_norm) / (total + _CLIP_EPS)).clamp(max=1.0)
    for grad in grads:
        # CPUOffload: shard gradients are host tensors, others may be on the device.
        grad.detach().mul_(clip_coef.to(grad.device, grad.dtype))
        release_resident(grad)
    return total.to(dtype)
