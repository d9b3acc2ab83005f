"""shardwrap: ZeRO-1/2/3 sharded data parallelism behind an FSDP-compatible API."""

from . import comm
from .checkpoint import (
    CheckpointError,
    CheckpointTiers,
    load_checkpoint,
    save_checkpoint,
    save_tiered,
)
from .ckpt.pretrained import load_pretrained
from .comm.checks import CollectiveTimeoutError, RankDisagreementError
from .comm.groups import hybrid_process_groups
from .comm.launch import init_distributed
from .data.sampler import ResumableSampler
from .deepspeed import pipe_module as pipe
from .deepspeed import zero_api as zero
from .deepspeed.engine import ShardedEngine
from .deepspeed.engine_choice import initialize
from .deepspeed.top_level_api import DeepSpeedConfig, add_config_arguments
from .features.forward_methods import register_forward_method
from .features.grad_scaler import ShardedGradScaler
from .fsdp1_options import (
    FullOptimStateDictConfig,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    StateDictConfig,
    StateDictSettings,
)
from .fsdp2 import FSDPModule, fully_shard, register_fsdp_forward_method
from .install import install, is_installed, uninstall
from .options import (
    BackwardPrefetch,
    CommQuantization,
    CPUOffload,
    DiskOffload,
    FullStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from .planner.estimate import estimate_memory
from .wrap import FullyShardedDataParallel, ShardedModule

__all__ = [
    "BackwardPrefetch",
    "CheckpointError",
    "CheckpointTiers",
    "CollectiveTimeoutError",
    "RankDisagreementError",
    "CommQuantization",
    "FullStateDictConfig",
    "FullOptimStateDictConfig",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "StateDictConfig",
    "StateDictSettings",
    "ShardedStateDictConfig",
    "StateDictType",
    "CPUOffload",
    "DeepSpeedConfig",
    "DiskOffload",
    "FSDPModule",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "PipelineEngine",
    "ResumableSampler",
    "ShardedEngine",
    "ShardedGradScaler",
    "ShardedModule",
    "ShardedPipelineStage",
    "ShardingStrategy",
    "add_config_arguments",
    "comm",
    "estimate_memory",
    "fully_shard",
    "hybrid_process_groups",
    "init_distributed",
    "initialize",
    "install",
    "is_installed",
    "load_checkpoint",
    "load_pretrained",
    "pipe",
    "register_forward_method",
    "register_fsdp_forward_method",
    "save_checkpoint",
    "save_tiered",
    "uninstall",
    "zero",
]
__version__ = "0.1.0"

# Imported on first use: torch.distributed.pipelining loads numpy and more.
_LAZY = {
    "ShardedPipelineStage": ("features.pipeline_stage", "ShardedPipelineStage"),
    "PipelineEngine": ("deepspeed.pipe_engine", "PipelineEngine"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'shardwrap' has no attribute {name!r}")
    import importlib

    module_name, attribute = _LAZY[name]
    return getattr(importlib.import_module(f".{module_name}", __name__), attribute)


version = __version__  # DeepSpeed scripts read deepspeed.version as well as __version__
