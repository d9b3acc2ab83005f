"""Reuse of the plain data-parallel gradient buffer (no process group).

See [Note: reusing the data-parallel gradient buffer] in ``shardwrap/grad_buffer.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwrap.grad_buffer import ReusableGradBuffer, held_only_by

NUMEL = 12


def test_a_lone_tensor_is_held_only_by_itself() -> None:
    buffer = torch.zeros(NUMEL)
    assert held_only_by(buffer)
    storage = buffer.untyped_storage()  # a kept Python storage object is not a holder
    assert held_only_by(buffer)
    del storage


def test_views_and_attached_gradients_hold_the_buffer() -> None:
    buffer = torch.zeros(NUMEL)
    view = buffer[2:5]
    assert not held_only_by(buffer)
    del view
    assert held_only_by(buffer)
    param = nn.Parameter(torch.zeros(3))
    param.grad = buffer[:3]
    assert not held_only_by(buffer)
    param.grad = None  # zero_grad(set_to_none=True)
    assert held_only_by(buffer)


def test_the_buffer_comes_back_only_when_nobody_else_holds_it() -> None:
    kept = ReusableGradBuffer()
    first = kept.take(NUMEL, torch.float32, torch.device("cpu"))
    first.fill_(1.0)
    assert kept.take(NUMEL, torch.float32, torch.device("cpu")) is first
    gradient = first[:4].view(2, 2)  # handed out as a .grad and kept by the user
    second = kept.take(NUMEL, torch.float32, torch.device("cpu"))
    assert second is not first
    second.fill_(2.0)
    assert torch.equal(gradient, torch.ones(2, 2))  # what the user holds is untouched
    del gradient
    assert kept.take(NUMEL, torch.float32, torch.device("cpu")) is second


def test_a_different_size_or_dtype_takes_a_new_buffer() -> None:
    kept = ReusableGradBuffer()
    first = kept.take(NUMEL, torch.float32, torch.device("cpu"))
    assert kept.take(NUMEL + 1, torch.float32, torch.device("cpu")) is not first
    other = kept.take(NUMEL, torch.bfloat16, torch.device("cpu"))
    assert other.dtype == torch.bfloat16 and other.numel() == NUMEL
