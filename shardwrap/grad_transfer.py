"""Gradients between the parameters' ``.grad`` and a unit's flat buffers.

Before a reduction, every full view's local gradient is copied into its slot of one flat
buffer. After it, the reduced buffer (this rank's shard) goes onto the shard views.
These are functions of tensors and the unit's layout; the handle keeps the state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .layout import FlatLayout


def flatten_local_grads(
    flat_grad: torch.Tensor,
    layout: FlatLayout,
    full_params: list[nn.Parameter],
    present: list[bool],
) -> None:
    """Move each full view's gradient into its slot of ``flat_grad`` (1D, padded).

    Every element is written once: a gradient, or zeros (no gradient, padding). The views'
    gradients are cleared, and ``present[i]`` set for each parameter that had one.
    """
    flat_grad[layout.unpadded_numel :].zero_()
    for index, (info, param) in enumerate(zip(layout.params, full_params, strict=True)):
        if param.grad is None:
            flat_grad[info.offset : info.end].zero_()
            continue
        flat_grad[info.offset : info.end].copy_(param.grad.reshape(-1))
        present[index] = True
        param.grad = None


def assign_reduced(
    shard_params: list[nn.Parameter],
    piece_of: Callable[[int], torch.Tensor],
    pending: torch.Tensor,
    global_present: list[bool],
) -> None:
    """Give every shard view that got a gradient on any rank its piece of ``pending``.

    ``piece_of(i)``: parameter ``i``'s piece of ``pending``. Views of ``pending`` when the
    pieces cover all of it (no padding, no frozen or absent parameter's slot): a copy per
    parameter would cost a pass over the gradient and hold nothing less. Otherwise copies,
    so that no dead slot outlives the step. A gradient already there is added to.
    """
    as_views = _pieces_cover(shard_params, piece_of, pending, global_present)
    for index, param in enumerate(shard_params):
        if not global_present[index]:
            continue
        grad = piece_of(index)
        if param.grad is None:
            param.grad = grad if as_views else grad.clone()
        else:
            param.grad.add_(grad)


def _pieces_cover(
    shard_params: list[nn.Parameter],
    piece_of: Callable[[int], torch.Tensor],
    pending: torch.Tensor,
    global_present: list[bool],
) -> bool:
    present = [i for i, is_present in enumerate(global_present) if is_present]
    if any(shard_params[i].grad is not None for i in present):
        return False  # accumulating onto earlier gradients: views would leave dead slots
    return sum(piece_of(i).numel() for i in present) == pending.numel()
