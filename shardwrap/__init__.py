"""shardwrap: ZeRO-1/2/3 sharded data parallelism behind an FSDP-compatible API."""

from .groups import hybrid_process_groups
from .options import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from .wrap import FullyShardedDataParallel, ShardedModule

__all__ = [
    "BackwardPrefetch",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "StateDictType",
    "CPUOffload",
    "FullyShardedDataParallel",
    "ShardedModule",
    "ShardingStrategy",
    "hybrid_process_groups",
]
__version__ = "0.1.0"
