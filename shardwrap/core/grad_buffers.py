"""Flat gradient buffers kept from step to step: a plain data-parallel unit's own buffer,
and a small pool of reduce-scatter inputs shared by a root's sharded units.

[Note: reusing the data-parallel gradient buffer]
Without sharding (NO_SHARD), a unit's local gradients are flattened into one buffer, the
buffer is all-reduced in place, and views of it become the parameters' ``.grad``. A new
buffer every step is fresh memory: glibc gives blocks of this size back to the kernel
when they are freed (``zero_grad``), and the copy into the next one takes a page fault
per 4 KiB. Measured on the benchmark machine (5M GPT, one model per process, as in
training): 2,300-3,000 faults and 147.6 ms per step, against 134.4 ms with the same
memory kept by the allocator.

So the buffer is kept and used again, but only when nothing outside this module still
holds it: once ``zero_grad`` has dropped the views (and no one kept a reference to a
gradient), only the kept tensor refers to its storage. A gradient still attached, or
kept by the user, makes the next step take a new buffer, so no value anyone can still
read is ever overwritten.

A sharded unit's flat gradient is only the reduce-scatter's input and is dropped when
that collective is done, so one root's units can share a few of them (:class:`ScratchPool`):
as many as there can be reductions in flight plus the one being filled. That is at most
a few units' worth of memory held between steps, the role a GPU caching allocator plays
for FSDP.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..base.torch_compat import storage_use_count


def held_only_by(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the only tensor on its storage (no view, no other alias)."""
    # The storage's Python object counts once; without the count nothing is reused.
    return storage_use_count(tensor.untyped_storage()) == 2


class ReusableGradBuffer:
    """One flat buffer handed out again each step while no one else holds it.

    Each :meth:`take` returns a new view of the kept buffer, so that whatever holds the
    view keeps the buffer from being handed out again.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.num_allocated = 0  # buffers created so far

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D buffer of ``numel`` elements: the kept one if free, else a new one (kept)."""
        kept = self._buffer
        if (
            kept is None
            or kept.numel() != numel
            or kept.dtype != dtype
            or kept.device != torch.device(device)
            or not held_only_by(kept)
        ):
            kept = self._buffer = torch.empty(numel, dtype=dtype, device=device)
            self.num_allocated += 1
        return _lent(kept)


class ScratchPool:
    """Flat buffers lent for one use each and taken back when no one holds them any more.

    ``capacity``: buffers kept per (numel, dtype, device); a request finding all of them
    in use gets a new buffer that is not kept.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.num_allocated = 0  # buffers created so far, kept or not
        self._kept: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D buffer of ``numel`` elements that nothing else holds (contents undefined)."""
        kept = self._kept.setdefault((numel, dtype, torch.device(device)), [])
        for buffer in kept:
            if held_only_by(buffer):
                return _lent(buffer)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self.num_allocated += 1
        if len(kept) < self.capacity:
            kept.append(buffer)
        return _lent(buffer)


class PlanBuffers:
    """The kept buffers of in-place bucket plans ([Note: in-place buckets]), by plan.

    Those used in the last step that reduced and in the current one are kept. A plan that
    goes a whole such step unused loses its buffer, so control flow that changes from step
    to step cannot pile buffers up. A step that reduced nothing (``no_sync``) does not
    count, so gradient accumulation keeps its buffers.
    """

    def __init__(self) -> None:
        self._current: dict[Hashable, ReusableGradBuffer] = {}
        self._previous: dict[Hashable, ReusableGradBuffer] = {}

    def for_plan(self, plan: Hashable) -> ReusableGradBuffer:
        """The buffer kept for ``plan`` (a new one the first time)."""
        buffer = self._current.get(plan) or self._previous.pop(plan, None) or ReusableGradBuffer()
        self._current[plan] = buffer
        return buffer

    def end_step(self) -> None:
        """Drop the buffers of plans that neither this step nor the last one used."""
        if self._current:
            self._previous, self._current = self._current, {}

    def buffers(self) -> list[ReusableGradBuffer]:
        """Every buffer kept now."""
        return [*self._current.values(), *self._previous.values()]


def _lent(buffer: torch.Tensor) -> torch.Tensor:
    # A view is a tensor of its own on the same storage: as long as it (or anything made
    # from it, a collective's reference included) is alive, the storage count says so.
    # Handing out the kept tensor itself would not: holders of the same tensor object
    # add nothing to the count.
    return buffer.view(-1)
