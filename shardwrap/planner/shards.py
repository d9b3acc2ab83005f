"""The most loaded rank's trainable shard elements, without visiting every rank.

[Note: the worst rank in O(1) ranks]
Shard ``r`` of a unit is the window ``[r s, (r + 1) s)`` of its flat buffer (``s`` the
shard size). A window that holds no *boundary* (an offset where ``requires_grad`` changes,
or the end of the unpadded buffer) lies inside one run: it holds ``s`` trainable elements
or none. So a unit's count is constant between the windows that hold a boundary, and so is
the sum over units; its maximum is at rank 0, at a rank holding a boundary, or at the rank
right after one. Those candidates number at most 1 + 2 x the boundaries, whatever the
number of ranks; each is counted with prefix sums of the trainable runs and a bisection.
With every parameter trainable (or every one frozen) the candidates are rank 0 and the
ranks around the unit's end, and rank 0 is the worst: shards differ by padding only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from ..layout.flat import FlatLayout


class _Runs:
    """A unit's trainable runs ``[start, end)`` and the trainable elements before each."""

    def __init__(self, layout: FlatLayout) -> None:
        self.layout = layout
        self.starts: list[int] = []
        self.ends: list[int] = []
        for info in layout.params:
            if not info.requires_grad or info.numel == 0:
                continue
            if self.ends and self.ends[-1] == info.offset:
                self.ends[-1] = info.end
            else:
                self.starts.append(info.offset)
                self.ends.append(info.end)
        self.before = [0]
        for start, end in zip(self.starts, self.ends, strict=True):
            self.before.append(self.before[-1] + end - start)

    def boundaries(self) -> list[int]:
        return [*self.starts, *self.ends, self.layout.unpadded_numel]

    def _upto(self, offset: int) -> int:
        """Trainable elements before ``offset``."""
        i = bisect.bisect_right(self.starts, offset) - 1
        if i < 0:
            return 0
        return self.before[i] + min(offset, self.ends[i]) - self.starts[i]

    def in_shard(self, rank: int) -> int:
        start, end = self.layout.shard_range(rank % self.layout.num_shards)
        return self._upto(end) - self._upto(start)


def worst_trainable_shard(layouts: Sequence[FlatLayout]) -> int:
    """``max`` over ranks of the trainable elements in the rank's shards of ``layouts``."""
    runs = [_Runs(layout) for layout in layouts]
    num_ranks = max((layout.num_shards for layout in layouts), default=1)
    candidates = {0}
    for unit in runs:
        if unit.layout.num_shards == 1 or unit.layout.shard_numel == 0:
            continue  # the same for every rank
        size = unit.layout.shard_numel
        for offset in unit.boundaries():
            candidates.update((offset // size, offset // size + 1))
    return max(sum(unit.in_shard(rank) for unit in runs) for rank in candidates if rank < num_ranks)
