"""The training loop's stall per checkpoint save: synchronous, asynchronous, and torch DCP.

Run: PYTHONPATH=$PWD python benchmarks/bench_async_ckpt.py [--sizes 30m] [--saves 4]
     [--world-size 2] [--root /tmp]

On ``--world-size`` gloo ranks (CPU), per GPT size (``benchmarks/gpt.py``; ``100m`` is
defined here), each of three savers in turn trains AdamW one step, then saves ``--saves``
times with one training step after each save:

* ``sync``: ``shardwrap.save_checkpoint`` (ZeRO-3, one unit per block);
* ``async``: the same with ``asynchronous=True`` (each save first waits for the last);
* ``dcp``: ``torch.distributed.checkpoint.async_save`` of the model's and optimizer's
  state dicts, torch FSDP2 (``fully_shard`` per block, then the root, as
  ``benchmarks/impls.py``'s ``_fsdp2``), waiting for the previous save's future first.

The stall of a save is the wall time of the call, the slowest rank's; saves are spaced
so that the previous one has finished (its wait is not timed). Printed: the first save's
stall (it allocates the staging buffers), the median of the later ones, the physical
floor (the bytes of a rank's state, parameters and optimizer state, over the memcpy
bandwidth measured here) and the median's ratio to it, the median time of the training
step right after a save (it runs beside the background write) and of the save's call
until it has finished plus that step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardwrap  # noqa: E402
from benchmarks import gpt  # noqa: E402
from shardwrap.policies import ModuleWrapPolicy  # noqa: E402

SIZES = {**gpt.SIZES, "100m": gpt.GPTConfig(vocab=1024, dim=1024, depth=8, num_heads=16, seq=64)}
SAVERS = ("sync", "async", "dcp")
BATCH = 2
MEMCPY_BYTES = 256 << 20


def memcpy_bandwidth() -> float:
    """Bytes per second of a host-to-host tensor copy (best of 5, 256 MiB)."""
    source = torch.ones(MEMCPY_BYTES // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return MEMCPY_BYTES / best


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters and optimizer state tensors (local shards)."""
    total = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            tensors = [param, *optimizer.state.get(param, {}).values()]
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                    total += local.numel() * local.element_size()
    return total


def build(saver: str, config: gpt.GPTConfig):
    model = gpt.build(config)
    if saver == "dcp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = shardwrap.ShardedModule(
            model, sharding_strategy="FULL_SHARD", auto_wrap_policy=ModuleWrapPolicy({gpt.Block})
        )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


class Saver:
    """One way of saving, with the previous save to wait for."""

    def __init__(self, kind: str, model, optimizer) -> None:
        self.kind = kind
        self.model = model
        self.optimizer = optimizer
        self.pending = None  # AsyncSave or a DCP future
        # DCP's background collectives need a group of their own (torchtitan's recipe):
        # on the training's group they interleave with its collectives.
        self.group = dist.new_group(backend="gloo") if kind == "dcp" else None

    def save(self, path: str) -> None:
        if self.kind == "sync":
            shardwrap.save_checkpoint(path, self.model, self.optimizer)
        elif self.kind == "async":  # waits for the previous save itself
            self.pending = shardwrap.save_checkpoint(
                path, self.model, self.optimizer, asynchronous=True
            )
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            self.finish()
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optim": optim_state}
            self.pending = dcp.async_save(state, checkpoint_id=path, process_group=self.group)

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None


def train_step(model, optimizer, config: gpt.GPTConfig, step: int) -> float:
    started = time.perf_counter()
    inputs, targets = gpt.batch(config, step=step, rank=dist.get_rank(), batch_size=BATCH)
    gpt.loss_fn(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - started


def measure(kind: str, config: gpt.GPTConfig, saves: int, root: str) -> dict:
    model, optimizer = build(kind, config)
    train_step(model, optimizer, config, 0)  # the optimizer's state exists from here
    saver = Saver(kind, model, optimizer)
    stalls, steps, totals = [], [], []
    for index in range(saves):
        saver.finish()  # saves far enough apart that the last one is done (not timed)
        dist.barrier()
        started = time.perf_counter()
        saver.save(os.path.join(root, kind, f"save{index}"))
        stalls.append(time.perf_counter() - started)
        steps.append(train_step(model, optimizer, config, index + 1))
        saver.finish()
        totals.append(time.perf_counter() - started)
    dist.barrier()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (stalls, totals))
    slowest = [max(rank[0][i] for rank in every) for i in range(saves)]
    total = statistics.median(max(rank[1][i] for rank in every) for i in range(saves))
    return {
        "stalls": slowest,
        "step": statistics.median(steps),
        "total": total,
        "bytes": state_bytes(optimizer),
    }


def rank_main(rank: int, world_size: int, init: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    bandwidth = memcpy_bandwidth()
    for size in args.sizes.split(","):
        root = tempfile.mkdtemp(dir=args.root) if rank == 0 else ""
        holder = [root]
        dist.broadcast_object_list(holder)
        root = holder[0]
        kinds = args.savers.split(",")
        rows = {kind: measure(kind, SIZES[size], args.saves, root) for kind in kinds}
        if rank == 0:
            report(size, rows, bandwidth, world_size)
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    dist.destroy_process_group()


def report(size: str, rows: dict, bandwidth: float, world_size: int) -> None:
    any_row = next(iter(rows.values()))
    floor = any_row["bytes"] / bandwidth
    print(
        f"\n{size} GPT, {world_size} ranks, {any_row['bytes'] / 2**20:.0f} MiB of state per "
        f"rank, memcpy {bandwidth / 2**30:.1f} GiB/s, floor {floor * 1e3:.0f} ms"
    )
    print(
        f"{'saver':>6} {'first ms':>9} {'median ms':>10} {'x floor':>8} {'step ms':>8} "
        f"{'save+step ms':>13}"
    )
    for kind, row in rows.items():
        later = row["stalls"][1:] or row["stalls"]
        median = statistics.median(later)
        kind_floor = row["bytes"] / bandwidth
        print(
            f"{kind:>6} {row['stalls'][0] * 1e3:9.0f} {median * 1e3:10.0f} "
            f"{median / kind_floor:8.1f} {row['step'] * 1e3:8.0f} {row['total'] * 1e3:13.0f}"
        )
    if "async" in rows and "dcp" in rows:
        ratio = statistics.median(rows["async"]["stalls"][1:] or rows["async"]["stalls"])
        ratio /= statistics.median(rows["dcp"]["stalls"][1:] or rows["dcp"]["stalls"])
        print(f"async / dcp median stall: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="30m", help=f"comma list of {sorted(SIZES)}")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--savers", default=",".join(SAVERS), help="comma list of sync,async,dcp")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--root", default=None, help="folder for the checkpoints (a temp dir)")
    args = parser.parse_args()
    for size in args.sizes.split(","):
        if size not in SIZES:
            parser.error(f"--sizes: unknown size {size!r}; choose from {sorted(SIZES)}")
    with tempfile.TemporaryDirectory() as scratch:
        init = os.path.join(scratch, "init")
        mp.spawn(rank_main, args=(args.world_size, init, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
