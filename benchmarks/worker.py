"""One rank of one implementation: build it, then run steps when the orchestrator says so.

Each implementation runs in its own pair of processes, so its peak RSS, its patched
collectives and any global state it installs (DeepSpeed's) stay its own. The
orchestrator sends ``("step", index)`` to both ranks of one implementation at a time and
``("finish", None)`` at the end; the worker answers on the shared result queue.
"""

from __future__ import annotations

import os
import resource
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks import gpt
from benchmarks.comm_count import CollectiveCounter


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    impl: str
    size: str
    rank: int
    world_size: int
    micro_batch: int
    dtype: str
    init_file: str


def status_kib(field: str) -> int:
    """A ``VmRSS``/``VmHWM``-style line of /proc/self/status, in KiB (0 if unavailable)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    hwm = status_kib("VmHWM")
    return 1024 * (hwm if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def run(config: WorkerConfig, commands, results) -> None:
    """Process entry point; every failure goes back to the orchestrator as text."""
    try:
        _serve(config, commands, results)
    except BaseException:  # noqa: BLE001 - the orchestrator reports it and goes on
        results.put((config.impl, config.rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(config: WorkerConfig, commands, results) -> None:
    from benchmarks.impls import IMPLS

    torch.set_num_threads(1)
    # FSDP1/DeepSpeed call collectives torch marks deprecated, once per step: noise here.
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(config.rank),
        LOCAL_RANK=str(config.rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_WORLD_SIZE=str(config.world_size),
    )
    counter = CollectiveCounter()
    counter.install()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{config.init_file}",
        rank=config.rank,
        world_size=config.world_size,
    )
    model_config = gpt.SIZES[config.size]
    torch.set_default_dtype(getattr(torch, config.dtype))
    baseline_rss = 1024 * status_kib("VmRSS")
    trainer = IMPLS[config.impl].build(
        gpt.build(model_config), micro_batch=config.micro_batch, world_size=config.world_size
    )
    results.put((config.impl, config.rank, "ready", None))
    while True:
        command, index = commands.get()
        if command == "finish":
            break
        inputs, targets = gpt.batch(
            model_config, step=index, rank=config.rank, batch_size=config.micro_batch
        )
        dist.barrier()  # both ranks start the clock together; not counted
        counter.counting = True
        start = time.perf_counter()
        loss = trainer.step(inputs, targets)
        elapsed = time.perf_counter() - start
        counter.counting = False
        step = {
            "index": index,
            "seconds": elapsed,
            "loss": loss,
            "collectives": counter.reset(),
            "profile": trainer.last_profile,
        }
        results.put((config.impl, config.rank, "step", step))
    final = {
        "model_state": trainer.model_state(),
        "peak_rss": peak_rss_bytes(),
        "num_threads": torch.get_num_threads(),
        "baseline_rss": baseline_rss,
        "profile_table": getattr(trainer, "last_profile_table", None),
    }
    results.put((config.impl, config.rank, "final", final))
