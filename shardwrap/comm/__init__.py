"""The only user of torch.distributed collectives: communicators, pairwise exchange, posting,
groups, the process group from a launcher.

As a package it is also DeepSpeed's ``deepspeed.comm`` for ``import shardwrap as
deepspeed``: torch.distributed's calls that DeepSpeed's examples use, plus DeepSpeed's
``init_distributed`` and ``get_local_rank``.
"""

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

from .launch import get_local_rank, init_distributed

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
