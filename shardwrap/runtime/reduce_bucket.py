"""Fusing the gradient reductions of several small units into one collective.

[Note: reduce buckets]
Each collective has a fixed cost (on gloo, a round of messages; on NCCL, a kernel launch),
so many small units reduce faster together. A bucket collects the flat gradients of
consecutive units (in backward order) that share the same groups and dtype, up to a byte
budget, and reduces them at once:

* sharded (``N`` ranks): the fused input is, rank by rank, each member's slice for that
  rank (``cat([g.view(N, -1) for g in grads], dim=1)``), so one reduce-scatter leaves this
  rank's slice of every member, end to end;
* one shard (data parallel): the members' flat gradients end to end, one all-reduce.

The members then finish as if reduced alone (replica all-reduce, scaling, accumulation).
The price is the bucket's memory: its members' flat gradients live until it is reduced.

[Note: in-place buckets]
Fusing by concatenation costs two passes over the bucket (the concatenation and a copy of
each member's part out of it), which measured slower than no bucket at all. A bucket of
one-shard members (data parallel, reduced by an in-place all-reduce) instead plans its
members when it opens: the unit whose backward just ended and the units whose backward
comes next (execution order, the same on every rank), up to the byte budget. It allocates
one buffer for all of them, and each member flattens its gradient straight into its slot.
The all-reduce runs in place on the filled slots, and each member keeps a view of its slot
as its reduced gradient, so no byte is copied beyond the flattening that happens anyway.
A member that arrives out of plan (a branch not taken) closes the bucket early: the
slots filled so far are reduced, and the newcomer opens the next bucket.

The buffer is kept from step to step per plan, on the same terms as a plain unit's own
gradient buffer ([Note: reusing the data-parallel gradient buffer]): it is filled again
only once nothing else holds any of its slots. Like a data-parallel unit's own
all-reduce, an in-place bucket is waited for only at the end of backward (see
[Note: reductions in flight] in runtime/schedule.py): it holds no memory beyond its members'
gradients, so issuing the next bucket never waits for it. A bucket that concatenates
holds its input until done, so it is waited for before the next one is issued.

[Note: default reduce buckets]
Data-parallel units (``NO_SHARD``, units kept whole by ``param_persistence_threshold``)
reduce in in-place buckets of 25 MiB by default, DDP's ``bucket_cap_mb``; sharded units
reduce alone, as FSDP's do, since their buckets concatenate. ``set_reduce_bucket_size``
sets one budget for both (0: every unit alone). On the benchmark machine (2 ranks
sharing 2 cores) an all-reduce overlapping backward saves no time, as there is no idle
core for it to use, while each one costs its own round of messages and thread wake-ups.
On the 5m model, whose seven units fit one bucket, the step went from 1.04-1.05 of DDP's
time to 1.00-1.02 in the phase timer (interleaved steps, two runs), and from a median of
1.05 to 1.035 in ``benchmarks/bench_step.py`` (five 30-round runs); on 30m (two blocks
to a bucket) it stayed within the noise of per-unit all-reduces (benchmarks/RESULTS.md,
run 13).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..comm import quantized
from ..core.grad_buffers import ReusableGradBuffer
from ..flat_param import FlatParamHandle


class ReduceBucket:
    """Flat gradients of several handles, reduced by a single collective."""

    def __init__(
        self, plan: list[FlatParamHandle] | None = None, slots: torch.Tensor | None = None
    ) -> None:
        self.handles: list[FlatParamHandle] = []
        self.grads: list[torch.Tensor] = []  # each 1D, padded, reduce_dtype
        self.num_bytes = 0
        self._work: Any = None
        self._output: torch.Tensor | None = None
        self._input: torch.Tensor | None = None  # alive until the collective is done
        # In place ([Note: in-place buckets]): the members expected, in order, and the one
        # buffer their slots share (1D, the plan's flat gradients end to end).
        self._plan = plan or []
        self._slots = slots
        self._filled = 0

    @classmethod
    def opened_by(
        cls,
        handle: FlatParamHandle,
        upcoming: list[FlatParamHandle],
        budget_bytes: int,
        slot_buffer_for: Callable[[tuple[FlatParamHandle, ...]], ReusableGradBuffer],
    ) -> ReduceBucket:
        """A bucket for ``handle``: planned in place when it reduces in place, else plain.

        ``slot_buffer_for``: the buffer kept for an in-place plan, which lends its slots.
        """
        if not handle.grads.reduces_in_place:
            return cls()
        plan = [handle]
        planned_bytes = _flat_grad_bytes(handle)
        for later in upcoming:
            # compatible with an in-place handle: one shard and the same replica group, so
            # in place too
            if planned_bytes >= budget_bytes or not _compatible(handle, later):
                break
            plan.append(later)
            planned_bytes += _flat_grad_bytes(later)
        numel = sum(h.grads.flat_grad_numel for h in plan)
        kept = slot_buffer_for(tuple(plan))
        return cls(plan, kept.take(numel, handle.reduce_dtype, handle.flat_full.device))

    @property
    def in_place(self) -> bool:
        """Whether the members' slots share one buffer, all-reduced in place."""
        return self._slots is not None

    def accepts(self, handle: FlatParamHandle) -> bool:
        if self._plan:
            index = len(self.handles)
            return index < len(self._plan) and self._plan[index] is handle
        return not self.handles or _compatible(self.handles[0], handle)

    def is_full(self, budget_bytes: int) -> bool:
        if self._plan:
            return len(self.handles) == len(self._plan)
        return self.num_bytes >= budget_bytes

    def add(self, handle: FlatParamHandle) -> None:
        if self._slots is not None:
            end = self._filled + handle.grads.flat_grad_numel
            grad = handle.grads.take_local_grads(out=self._slots[self._filled : end])
            self._filled = end
        else:
            grad = handle.grads.take_local_grads()
        self.handles.append(handle)
        self.grads.append(grad)
        self.num_bytes += grad.numel() * grad.element_size()

    @property
    def label(self) -> str:
        names = [h.comm_label for h in self.handles]
        return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)} units)"

    def issue(self) -> None:
        """Start the one collective for all members."""
        first = self.handles[0]
        if self._slots is not None:  # in place: every such bucket is planned
            self._input = self._output = self._slots[: self._filled]
            self._work = first.replicate_comm.all_reduce(
                self._output, purpose="grads", unit=self.label
            )
            return
        size = first.num_shards
        self._input = torch.cat([g.view(size, -1) for g in self.grads], dim=1).reshape(-1)
        self._output = torch.empty(
            self._input.numel() // size, dtype=self._input.dtype, device=self._input.device
        )
        self._work = quantized.reduce_scatter(  # qgZ quantizes it
            first.shard_comm,
            self._output,
            self._input,
            purpose="grads",
            unit=self.label,
            codec=first.grads.grad_codec,
        )

    def discard(self) -> None:
        """Wait for the collective, if issued, and hand nobody anything (a failed step)."""
        if self._work is not None:
            self._work.wait()
        self._input = self._output = self._work = self._slots = None
        self.grads.clear()

    def finish(self) -> None:
        """Wait, then hand each member its part."""
        self._work.wait()
        in_place = self.in_place  # every in-place handle's bucket is; cleared below
        offset = 0
        for handle, grad in zip(self.handles, self.grads, strict=True):
            numel = grad.numel() // handle.num_shards
            part = self._output[offset : offset + numel]
            # A slot is the member's own memory; a part of a concatenation would keep the
            # whole bucket alive.
            if not in_place:
                part = part.clone()
            handle.grads.accept_reduced(part, replicate_done=in_place)
            offset += numel
        self._input = self._output = self._work = self._slots = None
        self.grads.clear()


def _compatible(first: FlatParamHandle, handle: FlatParamHandle) -> bool:
    return (
        handle.shard_comm.group is first.shard_comm.group
        and handle.num_shards == first.num_shards
        and (handle.replicate_comm is None) == (first.replicate_comm is None)
        and (
            handle.replicate_comm is None
            or handle.replicate_comm.group is first.replicate_comm.group
        )
        and handle.reduce_dtype == first.reduce_dtype
        and handle.grads.grad_codec == first.grads.grad_codec
    )


def _flat_grad_bytes(handle: FlatParamHandle) -> int:
    return handle.grads.flat_grad_numel * handle.reduce_dtype.itemsize
