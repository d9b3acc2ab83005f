"""Schedule tuning: resharding after forward and bucket sizes.

Each setter changes how a root's step runtime schedules its units, never what it
computes; each takes the root it tunes.
"""

from __future__ import annotations

from ..assemble.root import ShardRoot
from ..assemble.sharding import check_bucket_bytes
from ..base.validate import check_bool
from ..base.warn_once import warn_once


def set_reshard_after_forward(root: ShardRoot, reshard: bool, *, root_only: bool = True) -> None:
    """Whether units free their gathered parameters after forward.

    ``False`` keeps them gathered until backward, as FSDP keeps its root: one all-gather
    less per unit and step, at the cost of that unit's full size in memory between
    forward and backward. ``root_only`` (default) applies it to the root's own unit.
    Strategies that never free (ZeRO-1, NO_SHARD) are unaffected.
    """
    value = check_bool("reshard", reshard)
    for unit in root.units[:1] if check_bool("root_only", root_only) else root.units:
        unit.set_reshard_after_forward(value)


def set_reduce_bucket_size(root: ShardRoot, num_bytes: int) -> None:
    """Fuse the gradient reductions of consecutive units up to ``num_bytes`` (0: off).

    Fewer, larger collectives (like DDP's buckets and DeepSpeed's
    ``reduce_bucket_size``), at the cost of holding up to ``num_bytes`` of flat
    gradients until their bucket is reduced. See [Note: reduce buckets]. Without a
    call, data-parallel units (``NO_SHARD``, persistent units) use 25 MiB buckets and
    sharded units reduce alone ([Note: default reduce buckets]); a call sets the
    budget of both.
    """
    root.runtime.schedule.reduce_bucket_bytes = check_bucket_bytes(num_bytes)


def set_all_gather_bucket_size(root: ShardRoot, num_bytes: int) -> None:
    """Fuse the all-gathers of consecutive units up to ``num_bytes`` gathered (0: off).

    A unit that must be gathered takes the units that come next along, so fewer,
    larger collectives move the same bytes, at the cost of holding up to
    ``num_bytes`` of gathered parameters ahead of use. See [Note: all-gather buckets].
    Units whose gathers ZeRO++ changes (qwZ, hpZ) gather alone: a warning says so.
    """
    root.runtime.schedule.all_gather_bucket_bytes = check_bucket_bytes(num_bytes)
    alone = [u for u in root.units if u.handle is not None and u.handle.comm_quant]
    if num_bytes and any(u.handle.comm_quant.changes_gathers for u in alone):
        warn_once(
            "set_all_gather_bucket_size",
            "units with quantized weights (qwZ) or hpZ secondary shards gather alone; "
            "the budget applies to the other units",
        )
