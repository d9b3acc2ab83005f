"""Gradients between the parameters' ``.grad`` and a unit's flat buffers.

Before a reduction, every full view's local gradient is copied into its slot of one flat
buffer. After it, the reduced buffer (this rank's shard) goes onto the shard views.
These are functions of tensors and the unit's layout; the handle keeps the state.

Where each gradient goes in the flat buffer: [Note: packed gradients] in layout/grad_slots.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..layout.grad_slots import GradSlots

# (parameter index, its gradient) -> the tensor to flatten for it.
LocalGrad = Callable[[int, torch.Tensor], torch.Tensor]


def flatten_local_grads(
    flat_grad: torch.Tensor,
    slots: GradSlots,
    full_params: list[nn.Parameter],
    present: list[bool],
    local_grad: LocalGrad | None = None,
) -> None:
    """Move each full view's gradient into its segments of ``flat_grad`` (1D,
    ``slots.numel``).

    Every element is written once: a gradient, or zeros (no gradient, a gap). The views'
    gradients are cleared, and ``present[i]`` set for each parameter that had one.
    ``local_grad(i, grad)``: the tensor to flatten for parameter ``i``'s gradient (a
    ``DTensor`` gradient's local block); the gradient itself when None.
    """
    if slots.end_to_end is not None and _flatten_end_to_end(
        flat_grad, slots, full_params, present, local_grad
    ):
        return
    for start, end in slots.gaps:
        flat_grad[start:end].zero_()
    for index, (segments, param) in enumerate(zip(slots.segments, full_params, strict=True)):
        grad = param.grad
        if grad is None:
            for segment in segments:
                flat_grad[segment.start : segment.end].zero_()
            continue
        flat = (grad if local_grad is None else local_grad(index, grad)).reshape(-1)
        for segment in segments:
            flat_grad[segment.start : segment.end].copy_(
                flat[segment.param_start : segment.param_end]
            )
        present[index] = True
        param.grad = None


def _flatten_end_to_end(
    flat_grad: torch.Tensor,
    slots: GradSlots,
    full_params: list[nn.Parameter],
    present: list[bool],
    local_grad: LocalGrad | None = None,
) -> bool:
    # One concatenation instead of a slice and a copy per parameter, whose Python cost is
    # most of a small unit's flattening; only when every trainable parameter has a gradient.
    indices = slots.end_to_end
    grads = [full_params[i].grad for i in indices]
    # (``out=`` refuses gradients that carry a graph, as under ``create_graph=True``.)
    if not grads or any(g is None for g in grads) or torch.is_grad_enabled():
        return False
    # The gaps are all past the gradients: these cover the rest of the buffer.
    filled = slots.numel - sum(end - start for start, end in slots.gaps)
    if local_grad is not None:
        grads = [local_grad(i, g) for i, g in zip(indices, grads, strict=True)]
    torch.cat([g.reshape(-1) for g in grads], out=flat_grad[:filled])
    for start, end in slots.gaps:
        flat_grad[start:end].zero_()
    for index in indices:
        present[index] = True
        full_params[index].grad = None
    return True


def assign_reduced(
    shard_params: list[nn.Parameter],
    piece_of: Callable[[int], torch.Tensor],
    pending: torch.Tensor,
    global_present: list[bool],
    *,
    pending_is_kept: bool = False,
    view: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Give every shard view that got a gradient on any rank its piece of ``pending``.

    ``piece_of(i)``: parameter ``i``'s piece of ``pending``. Views of ``pending`` when the
    pieces cover all of it (no padding, no frozen or absent parameter's slot): a copy per
    parameter would cost a pass over the gradient and hold nothing less. Otherwise copies,
    so that no dead slot outlives the step, unless ``pending_is_kept``: it lies in a
    buffer kept from step to step anyway ([Note: reusing the data-parallel gradient
    buffer]), so views hold nothing more. A gradient already there is added to.
    ``view(i, piece)``: what parameter ``i``'s gradient shows of its (plain) piece, e.g. a
    DTensor; the piece itself when None.
    """
    pieces = [piece_of(i) if present else None for i, present in enumerate(global_present)]
    given = [param for param, piece in zip(shard_params, pieces, strict=True) if piece is not None]
    accumulating = any(param.grad is not None for param in given)
    as_views = not accumulating and (pending_is_kept or _pieces_cover(pieces, pending))
    for index, (param, grad) in enumerate(zip(shard_params, pieces, strict=True)):
        if grad is None:
            continue
        if not as_views and param.grad is None:
            grad = grad.clone()
        if view is not None:
            grad = view(index, grad)
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


def _pieces_cover(pieces: list[torch.Tensor | None], pending: torch.Tensor) -> bool:
    return sum(piece.numel() for piece in pieces if piece is not None) == pending.numel()
