"""``ShardLayout``: which layout a root's units use, as a typed option of ``WrapOptions``.

``FLAT`` (``layout/flat.py``) makes each rank's shard one slice of the unit's flat buffer:
the FSDP1 and DeepSpeed doors. ``DIM0_CHUNKS`` (``layout/chunks.py``) makes it every
parameter's ``torch.chunk`` piece end to end, as FSDP2's ``Shard(0)`` does: the FSDP2 door.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

from .chunks import ChunkLayout
from .flat import FlatLayout

# The chunk layout's full views start at multiples of 64 elements: 64-byte aligned for every
# dtype, as the CPU allocator aligns a tensor of its own ([Note: aligned full views] in
# layout/chunks.py).
ALIGN_NUMEL = 64

LayoutBuilder = Callable[[list[tuple[str, tuple[int, ...], bool]], int], FlatLayout | ChunkLayout]


class ShardLayout(enum.Enum):
    """How a unit's parameters are laid out in its shards (see the module docstring)."""

    FLAT = "flat"
    DIM0_CHUNKS = "dim0_chunks"

    @property
    def children_first(self) -> bool:
        """Whether units take FSDP2's parameter order ([Note: FSDP2's parameter order] in
        layout/partition.py): the dim-0 chunks' door does."""
        return self is ShardLayout.DIM0_CHUNKS

    def builder(self, num_shards: int) -> LayoutBuilder:
        """The layout constructor for units sharded ``num_shards`` ways."""
        if self is ShardLayout.FLAT:
            return FlatLayout.build
        # One shard computes on the shard itself, which stays end to end: no alignment.
        align = ALIGN_NUMEL if num_shards > 1 else 1
        return functools.partial(ChunkLayout.build, align_numel=align)
