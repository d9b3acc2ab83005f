"""shardwrap: ZeRO-1/2/3 sharded data parallelism behind an FSDP-compatible API."""

from . import comm, zero
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .ds_compat import DeepSpeedConfig, add_config_arguments, init_distributed
from .engine import ShardedEngine, initialize
from .forward_methods import register_forward_method
from .grad_scaler import ShardedGradScaler
from .groups import hybrid_process_groups
from .options import (
    BackwardPrefetch,
    CPUOffload,
    DiskOffload,
    FullStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from .planner import estimate_memory
from .pretrained import load_pretrained
from .wrap import FullyShardedDataParallel, ShardedModule

__all__ = [
    "BackwardPrefetch",
    "CheckpointError",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "StateDictType",
    "CPUOffload",
    "DeepSpeedConfig",
    "DiskOffload",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardedEngine",
    "ShardedGradScaler",
    "ShardedModule",
    "ShardingStrategy",
    "add_config_arguments",
    "comm",
    "estimate_memory",
    "hybrid_process_groups",
    "init_distributed",
    "initialize",
    "load_checkpoint",
    "load_pretrained",
    "register_forward_method",
    "save_checkpoint",
    "zero",
]
__version__ = "0.1.0"
version = __version__  # DeepSpeed scripts read deepspeed.version as well as __version__
