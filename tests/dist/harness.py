"""Spawn ranks on CPU with gloo and collect each rank's result (or its traceback)."""

from __future__ import annotations

import os
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANK_TIMEOUT_S = 120.0  # generous for 2 loaded CPU cores; a hang fails instead of blocking CI


def _entry(rank: int, world_size: int, init_file: str, fn, args, queue) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs, queue, results: dict[int, Any], errors: list[str]) -> None:
    """Wait for every rank's report; stop early on a failure or on a rank that died silently."""
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while len(results) < len(procs):
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
            if dead:
                errors.append(f"ranks {dead} exited with codes {[procs[i].exitcode for i in dead]}")
                return
            if time.monotonic() > deadline:
                errors.append(f"ranks did not finish within {RANK_TIMEOUT_S}s (hang?)")
                return
            continue
        if not ok:
            errors.append(f"rank {rank}:\n{payload}")
            return
        results[rank] = payload


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, init_file, fn, args, queue))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            _collect(procs, queue, results, errors)
        finally:
            for p in procs:
                p.join(timeout=30 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
        # A rank that reported and then died at exit (an abort in teardown) still fails:
        # a job launcher would call the run failed. [Note: process groups at interpreter exit]
        exits = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if not errors and exits:
            errors.append(f"ranks exited with non-zero codes after reporting: {exits}")
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
