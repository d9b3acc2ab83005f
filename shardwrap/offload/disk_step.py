"""Disk offload: stepping Adam/AdamW over sub-groups of at most ``sub_group_size`` elements.

[Note: a streamed optimizer step]
Releasing the mapped pages after the step (see shardwrap/offload/disk.py) empties the rank
between steps, but the step itself touches the master shard and the Adam state of every
parameter, so at its peak they are all resident. When this rank's parameters that have a
gradient hold more than ``sub_group_size`` elements, a step pre-hook steps them itself:
it cuts them, in the optimizer's order, into sub-groups of at most ``sub_group_size``
elements (a parameter larger than what is left of a sub-group is cut into 1-D pieces,
views of the same memory), steps each sub-group with the optimizer's own step function
and ``param_groups`` narrowed to it (the same group dicts' hyperparameters, so an lr
scheduler's changes apply), and releases that sub-group's pages before the next one. The
optimizer's real step then finds those parameters without a gradient and skips them (it
still steps every other parameter it holds); a post-hook gives the gradients back.

Adam and AdamW update each element from that element's own values, the step count and
the hyperparameters, so stepping a piece computes what stepping the whole does. To the
bit, that needs one more thing: vectorised kernels (the fused CPU Adam among them) may
round the leftover elements after the last full SIMD vector differently, so a piece must
start where the whole parameter's vectors start: pieces are cut at multiples of
``PIECE_ALIGNMENT`` elements of the parameter. A piece gets views of the parameter's
state and a copy of its step count taken before any piece stepped; the stepped count is
written back.

The pre-hook runs after ZeRO-1's reduction of what ``no_sync`` left ([Note: one
optimizer-step dispatcher] in core/optimizer_step.py), so the gradients are final. A
``closure`` cannot be honoured: it would have to run before the first sub-group, and its
loss is what ``step`` returns; a streamed step with one is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..base.pages import release_resident

# Parameters are cut at multiples of this many elements (a multiple of every SIMD width).
PIECE_ALIGNMENT = 64


@dataclass(frozen=True, slots=True)
class Slice:
    """Elements ``[start, end)`` of the flattened ``param``, in param group ``group_index``."""

    group_index: int
    param: torch.Tensor
    start: int
    end: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == self.param.numel()


def sub_groups(
    params: list[tuple[int, torch.Tensor]], sub_group_size: int
) -> Iterator[list[Slice]]:
    """Consecutive runs of at most ``sub_group_size`` elements over ``(group, param)`` pairs.

    Parameters are cut only at multiples of ``PIECE_ALIGNMENT`` elements (see the Note), so
    a ``sub_group_size`` below it behaves as ``PIECE_ALIGNMENT``.
    """
    current: list[Slice] = []
    room = sub_group_size
    for group_index, param in params:
        start, numel = 0, param.numel()
        if numel == 0:  # an empty piece (padding): the optimizer still counts its step
            current.append(Slice(group_index, param, 0, 0))
        while start < numel:
            end = (
                numel
                if numel - start <= room
                else start + room // PIECE_ALIGNMENT * PIECE_ALIGNMENT
            )
            if end == start and current:  # no aligned cut fits: this sub-group is full
                yield current
                current, room = [], sub_group_size
                continue
            end = max(end, min(numel, start + PIECE_ALIGNMENT))
            current.append(Slice(group_index, param, start, end))
            room -= end - start
            start = end
            if room <= 0:
                yield current
                current, room = [], sub_group_size
    if current:
        yield current


class StreamedStep:
    """Steps one optimizer's parameters owned by a disk store in sub-groups (see the Note)."""

    def __init__(self, optimizer: torch.optim.Optimizer, sub_group_size: int) -> None:
        self.sub_group_size = sub_group_size
        hooked_step = type(optimizer).step
        assert getattr(hooked_step, "hooked", False), "torch wraps step() to run its hooks"
        self.step_function = hooked_step.__wrapped__  # the step without its hooks
        self.hidden_grads: dict[torch.Tensor, torch.Tensor] = {}  # until the real step is done
        self.num_sub_groups = 0  # of the last streamed step (for reports and tests)

    def before_step(self, optimizer, owned: set[int], args, kwargs) -> None:
        """Step the owned parameters with gradients in sub-groups; hide their gradients."""
        self.hidden_grads.clear()  # left over only if the last real step raised
        params = [
            (index, p)
            for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]
            if id(p) in owned and p.grad is not None
        ]
        if sum(p.numel() for _, p in params) <= self.sub_group_size:
            self.num_sub_groups = 1 if params else 0
            return  # one sub-group: the real step does it
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0]: the optimizer
        if closure is not None:
            raise ValueError(
                "DiskOffload: a step streamed in sub-groups (sub_group_size="
                f"{self.sub_group_size}) cannot take a closure; call step() without one"
            )
        start_steps = {id(p): optimizer.state[p]["step"].clone() for _, p in params}
        self.num_sub_groups = 0
        for sub_group in sub_groups(params, self.sub_group_size):
            self._step_sub_group(optimizer, sub_group, start_steps)
            self.num_sub_groups += 1
        for _, param in params:
            self.hidden_grads[param] = param.grad
            param.grad = None

    def after_step(self) -> None:
        """Give back the gradients hidden from the real step."""
        for param, grad in self.hidden_grads.items():
            param.grad = grad
        self.hidden_grads.clear()

    def _step_sub_group(self, optimizer, sub_group: list[Slice], start_steps: dict) -> None:
        pieces = [_piece(optimizer, s, start_steps) for s in sub_group]
        groups = optimizer.param_groups
        narrowed = [dict(g, params=[]) for g in groups]
        for slice_, piece in zip(sub_group, pieces, strict=True):
            narrowed[slice_.group_index]["params"].append(piece)
        try:
            optimizer.param_groups = narrowed
            self.step_function(optimizer)
        finally:
            optimizer.param_groups = groups
            for slice_, piece in zip(sub_group, pieces, strict=True):
                if not slice_.whole:
                    stepped = optimizer.state.pop(piece)
                    optimizer.state[slice_.param]["step"].copy_(stepped["step"])
        for slice_ in sub_group:
            param = slice_.param
            for tensor in (param, param.grad, *optimizer.state[param].values()):
                if torch.is_tensor(tensor) and tensor.shape == param.shape:
                    release_resident(tensor.detach().reshape(-1)[slice_.start : slice_.end])


def _piece(optimizer, slice_: Slice, start_steps: dict) -> torch.Tensor:
    """The tensor the optimizer steps for ``slice_``: the parameter, or a view of a piece."""
    param = slice_.param
    if slice_.whole:
        return param
    # detach() of a view shares the shard's version counter, so unshard sees the update.
    piece = param.detach().view(-1)[slice_.start : slice_.end]
    piece.grad = param.grad.detach().reshape(-1)[slice_.start : slice_.end]
    state = optimizer.state[param]
    optimizer.state[piece] = {
        name: (
            start_steps[id(param)].clone()
            if name == "step"
            else value.view(-1)[slice_.start : slice_.end]
        )
        for name, value in state.items()
    }
    return piece


__all__ = ["StreamedStep", "release_resident", "sub_groups"]
