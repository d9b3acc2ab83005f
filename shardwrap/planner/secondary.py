"""ZeRO++'s secondary partition (hpZ) in the planner: what each rank keeps for backward.

With ``hpz_partition_size = G`` a ZeRO-3 unit, after its forward all-gather, keeps a
second copy of its parameters partitioned over the ``G`` ranks of its smaller group, in
the compute dtype, until its backward gathers from it (``core/comm_quant.py``). Every unit
runs forward before any runs backward, so at the start of backward a rank holds its
``1/G`` of every sharded unit at once: ``P c / G`` (``P`` padded elements, ``c`` compute
bytes per element), the figure ``memory_by_category`` measures under ``full_params``.
The unit that runs last in forward stays gathered into its backward (counted among the
gathered parameters) and keeps no secondary shard; the planner cannot tell which unit that
is, so its figure is an upper bound by that unit's ``1/G``.
"""

from __future__ import annotations

import math

from ..options import ShardingStrategy
from .unit_sizes import ModelSizes

CATEGORY = "hpz_secondary"


def check_hpz(hpz_partition_size: int | None, world_size: int) -> int | None:
    """``hpz_partition_size`` validated against the shard group (None or 1: hpZ off, as in
    ``CommQuantization``)."""
    if hpz_partition_size is None:
        return None
    value = hpz_partition_size
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"hpz_partition_size: expected a positive int, got {value!r}")
    if world_size % value:
        raise ValueError(
            f"hpz_partition_size: {value} must divide world_size {world_size} (the secondary "
            "groups tile the shard group)"
        )
    return value


def hpz_numel(sizes: ModelSizes, strategy: ShardingStrategy, group: int | None) -> int:
    """Elements of the secondary shards one rank holds at the start of backward."""
    if group is None or group == 1 or strategy is not ShardingStrategy.FULL_SHARD:
        return 0
    return sum(
        math.ceil(u.layout.padded_numel / group) for u in sizes.units if u.layout.num_shards > 1
    )
