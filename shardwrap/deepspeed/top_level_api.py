"""DeepSpeed's top-level helpers, so that ``import shardwrap as deepspeed`` runs its scripts.

``add_config_arguments`` (``--deepspeed``, ``--deepspeed_config``), ``init_distributed``
(the default process group from the launcher's environment, see
[Note: the process group from the launcher] in ``comm/launch.py``), ``DeepSpeedConfig`` (a
parsed config that reads like DeepSpeed's), and the config lookup ``initialize`` shares
with them. ``shardwrap.zero`` and ``shardwrap.comm`` hold the rest.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from ..comm import collectives
from .config import BatchSizes
from .config import DeepSpeedConfig as ParsedConfig


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags to ``parser`` and return it.

    ``--deepspeed`` (a flag for the script's own use) and ``--deepspeed_config PATH`` (read
    by ``initialize(args=args)``), plus their deprecated ``--deepscale`` spellings.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configuration (shardwrap)")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="use DeepSpeed (shardwrap)"
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="path of a DeepSpeed JSON config"
    )
    group.add_argument(
        "--deepscale", default=False, action="store_true", help="deprecated: --deepspeed"
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config"
    )
    return parser


def config_from(args: Any, config: Any, config_params: Any) -> Any:
    """The config ``initialize`` uses: ``config``, ``config_params`` or the args' path."""
    if config is None:
        config = config_params
    elif config_params is not None:
        raise ValueError("initialize: give config or config_params, not both")
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is None:
        from_args = getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ValueError(
            "initialize: a config came both from args.deepspeed_config and from config=; "
            "give only one (as DeepSpeed requires)"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("config: give config=dict or a JSON path (or args.deepspeed_config)")
    if isinstance(config, DeepSpeedConfig):
        return config.parsed
    return config


class DeepSpeedConfig:
    """A config read as DeepSpeed's ``DeepSpeedConfig(config, mpu=None)`` reads it.

    Validates every key (``shardwrap.ds_config``). The batch sizes are derived with the
    world size of the current process group (1 without one), as DeepSpeed derives them.
    ``parsed`` is shardwrap's typed config; ``initialize(config=...)`` accepts either.
    """

    def __init__(
        self, config: Mapping | str | os.PathLike, mpu: Any = None, mesh_device: Any = None
    ) -> None:
        if mpu is not None or mesh_device is not None:
            raise ValueError("DeepSpeedConfig: mpu / mesh_device are not supported")
        self.parsed = ParsedConfig.load(config)
        self._param_dict = dict(config) if isinstance(config, Mapping) else None
        world = collectives.world_size() if collectives.is_initialized() else 1
        self.batch: BatchSizes = self.parsed.batch_sizes(world)
        self.train_batch_size = self.batch.train_batch_size
        self.train_micro_batch_size_per_gpu = self.batch.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = self.batch.gradient_accumulation_steps
        self.world_size = world
        self.gradient_clipping = self.parsed.gradient_clipping
        self.zero_config = self.parsed.zero_optimization
        self.zero_optimization_stage = self.zero_config.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.fp16_enabled = self.parsed.fp16.enabled
        self.bfloat16_enabled = self.parsed.bf16.enabled
        optimizer, scheduler = self.parsed.optimizer, self.parsed.scheduler
        self.optimizer_name = optimizer.type.value if optimizer else None
        self.optimizer_params = optimizer.kwargs if optimizer else None
        self.scheduler_name = scheduler.type.value if scheduler else None
        self.scheduler_params = dict(scheduler.params) if scheduler else None
        self.zero_allow_untested_optimizer = self.parsed.zero_allow_untested_optimizer
        self.dataloader_drop_last = self.parsed.dataloader_drop_last

    def __repr__(self) -> str:
        return f"DeepSpeedConfig({self.parsed!r})"
