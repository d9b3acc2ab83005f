"""Local gradients into a flat buffer and reduced gradients onto views (no process group)."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardwrap.core.grad_transfer import _flatten_end_to_end, assign_reduced, flatten_local_grads
from shardwrap.layout.flat import FlatLayout
from shardwrap.layout.grad_slots import GradSlots

SHAPES = [("a", (2, 3), True), ("b", (4,), True), ("c", (3,), True)]


def _params_with_grads(missing: str | None = None) -> list[nn.Parameter]:
    params = []
    for index, (name, shape, _) in enumerate(SHAPES):
        param = nn.Parameter(torch.zeros(shape))
        if name != missing:
            param.grad = torch.arange(param.numel(), dtype=torch.float32).view(shape) + 10 * index
        params.append(param)
    return params


def test_flatten_writes_every_slot_once_and_clears_the_views() -> None:
    layout = FlatLayout.build(SHAPES, num_shards=4)  # 13 elements, padded to 16
    params = _params_with_grads(missing="b")
    a_grad, c_grad = params[0].grad.reshape(-1), params[2].grad
    expected = torch.cat([a_grad, torch.zeros(4), c_grad, torch.zeros(3)])
    flat = torch.full((layout.padded_numel,), float("nan"))  # stale contents must not leak
    present = [False, False, False]
    flatten_local_grads(flat, GradSlots.for_layout(layout), params, present)
    assert torch.equal(flat, expected)
    assert present == [True, False, True]
    assert all(p.grad is None for p in params)


def test_flatten_packs_trainable_gradients_and_skips_frozen_slots() -> None:
    shapes = [("a", (2, 3), True), ("frozen", (4,), False), ("c", (3,), True)]
    layout = FlatLayout.build(shapes, num_shards=1)
    params = [nn.Parameter(torch.zeros(s), requires_grad=t) for _, s, t in shapes]
    params[0].grad = torch.ones(2, 3)
    params[2].grad = torch.full((3,), 2.0)
    flat = torch.full((9,), float("nan"))
    present = [False, False, False]
    flatten_local_grads(flat, GradSlots.for_layout(layout), params, present)
    assert torch.equal(flat, torch.tensor([1.0] * 6 + [2.0] * 3))
    assert present == [True, False, True]


def _pieces(pending: torch.Tensor, layout: FlatLayout):
    return lambda i: pending[layout.params[i].offset : layout.params[i].end].view(
        layout.params[i].shape
    )


def test_assign_hands_out_views_when_they_cover_the_buffer() -> None:
    layout = FlatLayout.build(SHAPES, num_shards=1)
    pending = torch.arange(13, dtype=torch.float32)
    params = [nn.Parameter(torch.zeros(shape)) for _, shape, _ in SHAPES]
    assign_reduced(params, _pieces(pending, layout), pending, [True, True, True])
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in params]), pending)
    assert all(p.grad.untyped_storage().data_ptr() == pending.data_ptr() for p in params)


class _Shown(torch.Tensor):
    """A tensor subclass whose ``numel()`` is not its storage's, as a DTensor's (global)."""

    def numel(self) -> int:
        return 2 * super().numel()


def test_assign_decides_views_on_the_plain_pieces_before_view_wraps_them() -> None:
    """The FSDP2 door's ``view`` (a DTensor per gradient) comes after the choice of views
    or copies: a wrapped piece's numel() is not its storage's (a DTensor's is global), and
    counting it there took every covering buffer for a dead slot and copied every gradient
    (found in a profile of the door's backward)."""
    layout = FlatLayout.build(SHAPES, num_shards=1)
    pending = torch.arange(13, dtype=torch.float32)
    params = [nn.Parameter(torch.zeros(shape)) for _, shape, _ in SHAPES]
    seen = []

    def view(index: int, piece: torch.Tensor) -> torch.Tensor:
        seen.append(index)
        return piece.as_subclass(_Shown)

    assign_reduced(params, _pieces(pending, layout), pending, [True] * 3, view=view)
    assert seen == [0, 1, 2] and all(type(p.grad) is _Shown for p in params)
    assert all(p.grad.untyped_storage().data_ptr() == pending.data_ptr() for p in params)
    # The control: the choice made on the wrapped pieces copies.
    wrapped = _pieces(pending, layout)
    params = [nn.Parameter(torch.zeros(shape)) for _, shape, _ in SHAPES]
    assign_reduced(params, lambda i: wrapped(i).as_subclass(_Shown), pending, [True] * 3)
    assert all(p.grad.untyped_storage().data_ptr() != pending.data_ptr() for p in params)


def test_assign_copies_when_a_slot_is_dead_and_adds_to_existing_grads() -> None:
    layout = FlatLayout.build(SHAPES, num_shards=1)
    pending = torch.arange(13, dtype=torch.float32)
    params = [nn.Parameter(torch.zeros(shape)) for _, shape, _ in SHAPES]
    assign_reduced(params, _pieces(pending, layout), pending, [True, False, True])
    assert params[1].grad is None  # no rank had a gradient for it
    assert params[0].grad.untyped_storage().data_ptr() != pending.data_ptr()  # a copy
    assert torch.equal(params[2].grad, pending[10:13])
    assign_reduced(params, _pieces(pending, layout), pending, [True, False, True])
    assert torch.equal(params[2].grad, 2 * pending[10:13])  # accumulated


def test_assign_hands_out_views_of_a_kept_buffer_despite_a_dead_slot() -> None:
    layout = FlatLayout.build(SHAPES, num_shards=1)
    pending = torch.arange(13, dtype=torch.float32)
    params = [nn.Parameter(torch.zeros(shape)) for _, shape, _ in SHAPES]
    present = [True, False, True]
    assign_reduced(params, _pieces(pending, layout), pending, present, pending_is_kept=True)
    assert params[1].grad is None
    assert params[0].grad.untyped_storage().data_ptr() == pending.data_ptr()  # a view
    assert torch.equal(params[2].grad, pending[10:13])
    later = torch.ones(13)  # a second reduction before the optimizer step
    assign_reduced(params, _pieces(later, layout), later, present, pending_is_kept=True)
    assert torch.equal(params[2].grad, pending[10:13])  # added to the same storage
    assert torch.equal(pending[10:13], torch.tensor([11.0, 12.0, 13.0]))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=5),
    st.integers(1, 4),
    st.data(),
)
def test_the_concatenating_fast_path_writes_what_the_slice_path_writes(entries, shards, data):
    shapes = [(f"p{i}", (numel,), trains) for i, (numel, trains) in enumerate(entries)]
    layout = FlatLayout.build(shapes, num_shards=shards)
    slots = GradSlots.for_layout(layout)
    has_grad = data.draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    buffers, presents = [], []
    for use_fast_path in (True, False):
        params = [nn.Parameter(torch.zeros(s), requires_grad=t) for _, s, t in shapes]
        for index, (param, (_, _, trains)) in enumerate(zip(params, shapes)):
            if trains and has_grad[index]:
                param.grad = torch.arange(param.numel(), dtype=torch.float32) + 100 * index
        flat = torch.full((slots.numel,), float("nan"))
        present = [False] * len(shapes)
        chosen = slots if use_fast_path else dataclasses.replace(slots, end_to_end=None)
        with torch.no_grad():  # as in backward, where the fast path applies
            flatten_local_grads(flat, chosen, params, present)
        assert all(p.grad is None for p in params)
        buffers.append(flat)
        presents.append(present)
    assert torch.equal(buffers[0], buffers[1])  # no NaN left either: every element written
    assert presents[0] == presents[1]


def test_the_fast_path_runs_when_every_trainable_gradient_is_there() -> None:
    layout = FlatLayout.build(SHAPES, num_shards=4)
    params = _params_with_grads()
    flat = torch.full((layout.padded_numel,), float("nan"))
    present = [False] * 3
    with torch.no_grad():
        assert _flatten_end_to_end(flat, GradSlots.for_layout(layout), params, present)
    assert torch.equal(flat[13:], torch.zeros(3)) and present == [True] * 3
    params = _params_with_grads(missing="b")  # a missing gradient takes the slice path
    with torch.no_grad():
        assert not _flatten_end_to_end(flat, GradSlots.for_layout(layout), params, present)
