"""shardwrap: ZeRO-1/2/3 sharded data parallelism behind an FSDP-compatible API."""

from .engine import ShardedEngine, initialize
from .groups import hybrid_process_groups
from .options import BackwardPrefetch, CPUOffload, ShardingStrategy
from .planner import estimate_memory
from .wrap import FullyShardedDataParallel, ShardedModule

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullyShardedDataParallel",
    "ShardedEngine",
    "ShardedModule",
    "ShardingStrategy",
    "estimate_memory",
    "hybrid_process_groups",
    "initialize",
]
__version__ = "0.1.0"
