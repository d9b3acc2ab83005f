"""shardwrap: ZeRO-1/2/3 sharded data parallelism behind an FSDP-compatible API."""

from .forward_methods import register_forward_method
from .grad_scaler import ShardedGradScaler
from .groups import hybrid_process_groups
from .options import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    MixedPrecision,
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
    "MixedPrecision",
    "ShardedGradScaler",
    "ShardedModule",
    "ShardingStrategy",
    "hybrid_process_groups",
    "register_forward_method",
]
__version__ = "0.1.0"
