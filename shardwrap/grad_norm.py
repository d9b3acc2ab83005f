"""Clipping the global gradient norm when each rank holds only its shard of the gradients.

[Note: whose gradients count once]
After reduction every rank holds disjoint pieces of every gradient (padding excluded,
tied parameters once), so the global squared norm is the sum of the local squared norms
over the shard group. With one shard (NO_SHARD, or a world of one) every rank already
holds the whole reduced gradient: summing over ranks would count it N times, and the
shard communicator of one rank correctly adds nothing. Replicas of a hybrid layout hold
the same shard, so only the shard group is summed over.
"""

from __future__ import annotations

import torch

from .wrap import ShardedModule

# As torch.nn.utils.clip_grad_norm_: keeps the coefficient finite for a zero norm.
_NORM_EPSILON = 1e-6


def sharded_grad_norm(model: ShardedModule, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's reduced gradient (same value on every rank)."""
    if norm_type != 2.0:
        raise ValueError(f"norm_type: only the 2-norm is supported, got {norm_type!r}")
    handles = [u.handle for u in model.units if u.handle is not None]
    if not handles:
        return torch.zeros(())
    grads = [p.grad for h in handles for p in h.shard_params if p.grad is not None]
    device = handles[0].flat_shard.device
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        squared += grad.detach().float().pow(2).sum()
    handles[0].shard_comm.all_reduce(squared, purpose="grad_norm").wait()
    return squared.sqrt()


def clip_sharded_grad_norm_(model: ShardedModule, max_norm: float) -> torch.Tensor:
    """Scale every reduced gradient by ``min(1, max_norm / (norm + 1e-6))``; returns the norm."""
    if not max_norm > 0:
        raise ValueError(f"max_norm: must be > 0, got {max_norm!r}")
    total = sharded_grad_norm(model)
    coefficient = torch.clamp(max_norm / (total + _NORM_EPSILON), max=1.0)
    for unit in model.units:
        if unit.handle is None:
            continue
        for param in unit.handle.shard_params:
            if param.grad is not None:
                param.grad.mul_(coefficient.to(param.grad.dtype))
    return total
