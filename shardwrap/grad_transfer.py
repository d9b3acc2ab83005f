"""Gradients between the parameters' ``.grad`` and a unit's flat buffers.

Before a reduction, every full view's local gradient is copied into its slot of one flat
buffer. After it, the reduced buffer (this rank's shard) goes onto the shard views.
These are functions of tensors and the unit's layout; the handle keeps the state.

[Note: packed gradients]
A sharded unit's flat gradient is a reduce-scatter's input: rank ``r`` receives the sum
of everyone's ``r``-th chunk, and that chunk has to hold exactly the elements of ``r``'s
parameter shard. So its slots follow the parameter layout (:meth:`GradSlots.along`),
frozen parameters and padding included, and those slots travel as zeros. A unit reduced
by an in-place all-reduce (one shard: NO_SHARD, or kept whole by the persistence
threshold) has no chunks to line up, so its buffer holds the trainable parameters alone,
end to end (:meth:`GradSlots.packed`), as DDP's buckets do: a frozen parameter costs no
bytes on the wire and none in the gradient buffer kept between steps. (A fine-tuned model
whose units hold large frozen weights next to small trainable ones reduces only the
latter.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .layout import GradSlots


def flatten_local_grads(
    flat_grad: torch.Tensor,
    slots: GradSlots,
    full_params: list[nn.Parameter],
    present: list[bool],
) -> None:
    """Move each full view's gradient into its slot of ``flat_grad`` (1D, ``slots.numel``).

    Every element is written once: a gradient, or zeros (no gradient, padding). The views'
    gradients are cleared, and ``present[i]`` set for each parameter that had one. A
    parameter without a slot is frozen, so it has no gradient to move.
    """
    flat_grad[slots.filled_numel :].zero_()
    for index, (slot, param) in enumerate(zip(slots.ranges, full_params, strict=True)):
        if slot is None:
            continue
        start, end = slot
        if param.grad is None:
            flat_grad[start:end].zero_()
            continue
        flat_grad[start:end].copy_(param.grad.reshape(-1))
        present[index] = True
        param.grad = None


def assign_reduced(
    shard_params: list[nn.Parameter],
    piece_of: Callable[[int], torch.Tensor],
    pending: torch.Tensor,
    global_present: list[bool],
    *,
    pending_is_kept: bool = False,
) -> None:
    """Give every shard view that got a gradient on any rank its piece of ``pending``.

    ``piece_of(i)``: parameter ``i``'s piece of ``pending``. Views of ``pending`` when the
    pieces cover all of it (no padding, no frozen or absent parameter's slot): a copy per
    parameter would cost a pass over the gradient and hold nothing less. Otherwise copies,
    so that no dead slot outlives the step, unless ``pending_is_kept``: it lies in a
    buffer kept from step to step anyway ([Note: reusing the data-parallel gradient
    buffer]), so views hold nothing more. A gradient already there is added to.
    """
    pieces = [piece_of(i) if present else None for i, present in enumerate(global_present)]
    given = [param for param, piece in zip(shard_params, pieces, strict=True) if piece is not None]
    accumulating = any(param.grad is not None for param in given)
    as_views = not accumulating and (pending_is_kept or _pieces_cover(pieces, pending))
    for param, grad in zip(shard_params, pieces, strict=True):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad if as_views else grad.clone()
        else:
            param.grad.add_(grad)


def _pieces_cover(pieces: list[torch.Tensor | None], pending: torch.Tensor) -> bool:
    return sum(piece.numel() for piece in pieces if piece is not None) == pending.numel()
