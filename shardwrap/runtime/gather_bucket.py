"""Fusing the all-gathers of units that come next into one collective.

[Note: all-gather buckets]
The all-gather of a small unit costs mostly its fixed latency. With a byte budget set
(``ShardedModule.set_all_gather_bucket_size``), a unit that has to be gathered right
now takes along the units that come next (in the previous step's forward order during
forward, in the order backward will reach them during backward), as long as they share
its shard group and compute dtype and their gathered buffers fit the budget together.
Units on the way whose copy is current or already on its way (kept gathered, prefetched)
need no gather and are passed over. One all-gather then moves all of them:

* input: each member's shard (cast to the compute dtype), end to end;
* output: rank by rank, those inputs, i.e. a ``(num_shards, sum of shard sizes)`` matrix
  whose columns ``[offset, offset + shard_numel)`` are one member's gathered buffer in
  rank-major order, exactly what its own all-gather would have written.

The fused gather is every member's gather in flight (:class:`FusedGather`): whichever
member is needed first waits for it, and then every member copies its columns into its
``flat_full`` and records the shard version it gathered, so the others find their
copies current and issue nothing. Prefetches bucket the same way, so a bucket issued
ahead overlaps computation as a single unit's prefetch does. The bytes moved are those
of unit-by-unit gathers; the count of collectives drops. The price: up to the budget of
gathered parameters is held ahead of use (``limit_all_gathers`` counts a bucket as one
unit). A member gathered but not used in the step is released at the end of the step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..flat_param import FlatParamHandle


def needs_gather(handle: FlatParamHandle) -> bool:
    """Whether ``handle``'s gathered copy is stale and would be all-gathered."""
    return (
        handle.num_shards > 1
        and handle.separate_full
        and not handle.gather_in_flight
        and not handle.full_is_current
    )


def _compatible(first: FlatParamHandle, other: FlatParamHandle) -> bool:
    return (
        other.user_comms.all_gather is None  # a user's all-gather gathers its unit alone
        and other.shard_comm.group is first.shard_comm.group
        and other.num_shards == first.num_shards
        and other.compute_dtype == first.compute_dtype
        and other.compute_device == first.compute_device
    )


def _full_bytes(handle: FlatParamHandle) -> int:
    return handle.flat_full.numel() * handle.flat_full.element_size()


def collect(
    first: FlatParamHandle, upcoming: Iterable[FlatParamHandle], budget_bytes: int
) -> list[FlatParamHandle]:
    """``first`` and the ``upcoming`` handles that fit one bucket, in order.

    Handles whose gathered copy is current or on its way (a unit kept gathered, a
    prefetch) need nothing and are passed over; the bucket ends at the first one that
    does not fit.
    """
    members = [first]
    if first.comm_quant is not None and first.comm_quant.changes_gathers:
        return members  # ZeRO++ gathers go alone ([Note: ZeRO++ in a unit])
    if first.user_comms.all_gather is not None:
        return members  # so does a user's ([Note: user communicators] in comm/user_comms.py)
    total = _full_bytes(first)
    for handle in upcoming:
        if handle in members or not _compatible(first, handle):
            break
        if not needs_gather(handle):
            continue
        if total + _full_bytes(handle) > budget_bytes:
            break
        members.append(handle)
        total += _full_bytes(handle)
    return members


class FusedGather:
    """One all-gather in flight for several handles; its first wait hands each its part.

    Every member holds it as its own gather in flight, so whichever member is needed (or
    released) first waits for it, and the others then find their copies current.
    """

    def __init__(self, members: list[FlatParamHandle]) -> None:
        first = members[0]
        self.members = members
        self.versions = [h.shard_version for h in members]
        # 1D: each member's shard, cast to the compute dtype on the compute device (staged
        # from host memory under CPUOffload, which each member's wait completes), end to
        # end; alive until the collective is done
        sources = [h.gather_source() for h in members]
        self._input = torch.cat([tensor for tensor, _ in sources])
        # 1D: num_shards copies of such an input, rank by rank
        self._output = torch.empty(
            first.num_shards * self._input.numel(),
            dtype=self._input.dtype,
            device=self._input.device,
        )
        label = f"{first.comm_label}..{members[-1].comm_label} ({len(members)} units)"
        self._work = first.shard_comm.all_gather(
            self._output, self._input, purpose="params", unit=label
        )
        for handle, version, (_, staged) in zip(members, self.versions, sources, strict=True):
            handle.adopt_gather(self, version=version, staged=staged)

    def wait(self) -> bool:
        if self._work is None:
            return True
        self._work.wait()
        by_rank = self._output.view(self.members[0].num_shards, -1)  # row r: rank r's shards
        offset = 0
        for handle, version in zip(self.members, self.versions, strict=True):
            width = handle.layout.shard_numel
            handle.accept_gathered(by_rank[:, offset : offset + width], version=version)
            offset += width
        self._work = self._input = self._output = None
        return True
