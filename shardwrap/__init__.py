"""shardwrap: ZeRO-1/2/3 sharded data parallelism behind an FSDP-compatible API."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
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
from .pretrained import load_pretrained
from .wrap import FullyShardedDataParallel, ShardedModule

__all__ = [
    "BackwardPrefetch",
    "CheckpointError",
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
    "load_checkpoint",
    "load_pretrained",
    "register_forward_method",
    "save_checkpoint",
]
__version__ = "0.1.0"
