"""DeepSpeed's top-level helpers, so that ``import shardwrap as deepspeed`` runs its scripts.

``add_config_arguments`` (``--deepspeed``, ``--deepspeed_config``), ``init_distributed``
(the default process group from the launcher's environment), ``DeepSpeedConfig`` (a
parsed config that reads like DeepSpeed's), and the config lookup ``initialize`` shares
with them. ``shardwrap.zero`` and ``shardwrap.comm`` hold the rest.

[Note: the process group initialize sets up]
DeepSpeed's ``initialize`` sets up the default process group itself when none exists, from
the environment a launcher (``deepspeed``, ``torchrun``) sets: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` (``LOCAL_RANK`` picks the GPU). We do the same, with
``nccl`` when CUDA is available and ``gloo`` otherwise. DeepSpeed falls back to MPI
discovery when the variables are missing; we do not (no mpi4py), so a script started
without a launcher gets an error naming the missing variables, unless it passes rank and
world size, or it is the one process of a one-process run (``WORLD_SIZE`` unset and
``RANK`` unset: we start a one-rank group on ``localhost``, as ``torchrun
--nproc-per-node 1`` would).
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import collectives
from .ds_config import BatchSizes
from .ds_config import DeepSpeedConfig as ParsedConfig

DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Set up the default process group unless one exists ([Note: the process group ...]).

    DeepSpeed's signature; ``auto_mpi_discovery``, ``verbose`` and ``config`` are
    accepted and unused. ``dist_init_required=False`` only checks that a group exists.
    """
    del auto_mpi_discovery, verbose, config
    if collectives.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError(
            "init_distributed: dist_init_required=False but no process group is initialised"
        )
    env = os.environ
    if rank < 0 and world_size < 0 and "RANK" not in env and "WORLD_SIZE" not in env:
        rank, world_size = 0, 1  # one process without a launcher
        env.setdefault("MASTER_ADDR", "localhost")
    if rank < 0 or world_size < 0:
        missing = [name for name in _LAUNCHER_ENV if name not in env]
        if missing:
            raise RuntimeError(
                f"init_distributed: no process group, and the launcher's environment lacks "
                f"{', '.join(missing)}; start the script with torchrun or deepspeed, or call "
                "torch.distributed.init_process_group(...) first"
            )
    if "MASTER_PORT" not in env and init_method is None:
        env["MASTER_PORT"] = str(distributed_port)
    env.setdefault("MASTER_ADDR", "localhost")
    cuda = torch.cuda.is_available()
    backend = dist_backend or ("nccl" if cuda else "gloo")
    if cuda and backend == "nccl":
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    kwargs: dict[str, Any] = {"backend": backend, "init_method": init_method or "env://"}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size >= 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(**kwargs)


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
