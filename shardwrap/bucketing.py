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
"""

from __future__ import annotations

from typing import Any

import torch

from .flat_param import FlatParamHandle


class ReduceBucket:
    """Flat gradients of several handles, reduced by a single collective."""

    def __init__(self) -> None:
        self.handles: list[FlatParamHandle] = []
        self.grads: list[torch.Tensor] = []  # each 1D, padded, reduce_dtype
        self.num_bytes = 0
        self._work: Any = None
        self._output: torch.Tensor | None = None
        self._input: torch.Tensor | None = None  # alive until the collective is done

    def accepts(self, handle: FlatParamHandle) -> bool:
        if not self.handles:
            return True
        first = self.handles[0]
        return (
            handle.shard_comm.group is first.shard_comm.group
            and handle.num_shards == first.num_shards
            and (handle.replicate_comm is None) == (first.replicate_comm is None)
            and (
                handle.replicate_comm is None
                or handle.replicate_comm.group is first.replicate_comm.group
            )
            and handle.reduce_dtype == first.reduce_dtype
        )

    def add(self, handle: FlatParamHandle) -> None:
        grad = handle.take_local_grads()
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
        if first.num_shards == 1 and first.replicate_comm is not None:
            self._input = self._output = torch.cat(self.grads)
            self._work = first.replicate_comm.all_reduce(
                self._output, purpose="grads", unit=self.label
            )
            return
        size = first.num_shards
        self._input = torch.cat([g.view(size, -1) for g in self.grads], dim=1).reshape(-1)
        self._output = torch.empty(
            self._input.numel() // size, dtype=self._input.dtype, device=self._input.device
        )
        self._work = first.shard_comm.reduce_scatter(
            self._output, self._input, purpose="grads", unit=self.label
        )

    def finish(self) -> None:
        """Wait, then hand each member its part."""
        self._work.wait()
        first = self.handles[0]
        replicate_done = first.num_shards == 1 and first.replicate_comm is not None
        offset = 0
        for handle, grad in zip(self.handles, self.grads, strict=True):
            numel = grad.numel() // handle.num_shards
            part = self._output[offset : offset + numel]
            handle.accept_reduced(part.clone(), replicate_done=replicate_done)
            offset += numel
        self._input = self._output = self._work = None
        self.grads.clear()
