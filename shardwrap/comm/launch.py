"""The default process group from a launcher's environment, as DeepSpeed sets it up.

[Note: the process group from the launcher]
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

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from . import collectives

DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def get_local_rank() -> int:
    """The launcher's ``LOCAL_RANK`` (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


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
    """Set up the default process group unless one exists.

    See [Note: the process group from the launcher].

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
