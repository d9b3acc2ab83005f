"""``deepspeed.comm`` for ``import shardwrap as deepspeed``: torch.distributed, plus DeepSpeed's
``init_distributed`` and ``get_local_rank``."""

from __future__ import annotations

import os

from torch.distributed import (
    ReduceOp,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    get_rank,
    get_world_size,
    is_initialized,
    reduce_scatter,
)

from .ds_compat import init_distributed


def get_local_rank() -> int:
    """The launcher's ``LOCAL_RANK`` (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "reduce_scatter",
]
