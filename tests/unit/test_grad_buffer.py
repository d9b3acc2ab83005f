"""Reuse of the plain data-parallel gradient buffer (no process group).

See [Note: reusing the data-parallel gradient buffer] in ``shardwrap/core/grad_buffers.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwrap.core.grad_buffers import PlanBuffers, ReusableGradBuffer, ScratchPool, held_only_by

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


CPU = torch.device("cpu")


def test_the_buffer_comes_back_only_when_nobody_else_holds_it() -> None:
    kept = ReusableGradBuffer()
    first = kept.take(NUMEL, torch.float32, CPU)
    first_ptr = first.data_ptr()
    first.fill_(1.0)
    del first  # the reduction is over and its gradients are gone
    again = kept.take(NUMEL, torch.float32, CPU)
    assert again.data_ptr() == first_ptr
    gradient = again[:4].view(2, 2)  # handed out as a .grad and kept by the user
    del again
    second = kept.take(NUMEL, torch.float32, CPU)
    assert second.data_ptr() != first_ptr
    second.fill_(2.0)
    assert torch.equal(gradient, torch.ones(2, 2))  # what the user holds is untouched
    second_ptr = second.data_ptr()
    del gradient, second
    assert kept.take(NUMEL, torch.float32, CPU).data_ptr() == second_ptr


def test_a_buffer_in_use_is_not_handed_out_twice() -> None:
    kept = ReusableGradBuffer()
    in_flight = kept.take(NUMEL, torch.float32, CPU)  # e.g. held by a collective
    assert kept.take(NUMEL, torch.float32, CPU).data_ptr() != in_flight.data_ptr()


def test_a_different_size_or_dtype_takes_a_new_buffer() -> None:
    kept = ReusableGradBuffer()
    first = kept.take(NUMEL, torch.float32, CPU)
    assert kept.take(NUMEL + 1, torch.float32, CPU).data_ptr() != first.data_ptr()
    other = kept.take(NUMEL, torch.bfloat16, CPU)
    assert other.dtype == torch.bfloat16 and other.numel() == NUMEL


def test_the_pool_lends_each_buffer_once_and_keeps_at_most_capacity() -> None:
    pool = ScratchPool(capacity=2)
    a = pool.take(NUMEL, torch.float32, CPU)
    b = pool.take(NUMEL, torch.float32, CPU)
    c = pool.take(NUMEL, torch.float32, CPU)  # both kept buffers lent: a third, not kept
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    assert pool.num_allocated == 3
    kept_ptrs = {a.data_ptr(), b.data_ptr()}
    del a, b, c
    again = [pool.take(NUMEL, torch.float32, CPU) for _ in range(2)]
    assert {t.data_ptr() for t in again} == kept_ptrs
    assert pool.num_allocated == 3  # nothing new
    other_size = pool.take(NUMEL + 2, torch.float32, CPU)
    assert other_size.numel() == NUMEL + 2 and pool.num_allocated == 4


def test_the_pool_checks_its_capacity() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ScratchPool(capacity=0)


def test_plan_buffers_keep_the_plans_of_the_last_two_reducing_steps() -> None:
    plans = PlanBuffers()
    first = plans.for_plan(("a", "b"))
    assert plans.for_plan(("a", "b")) is first  # the same plan twice in one step
    plans.end_step()
    other = plans.for_plan(("c",))  # control flow changed: another plan
    plans.end_step()
    assert set(map(id, plans.buffers())) == {id(other)}  # ("a", "b") unused for a step
    assert plans.for_plan(("a", "b")) is not first


def test_plan_buffers_survive_steps_that_reduce_nothing() -> None:
    plans = PlanBuffers()
    kept = plans.for_plan(("a",))
    plans.end_step()
    for _ in range(3):  # no_sync backwards: no plan used
        plans.end_step()
    assert plans.for_plan(("a",)) is kept
    plans.end_step()
    plans.end_step()
    assert plans.buffers() == [kept]  # kept by the last step that reduced
