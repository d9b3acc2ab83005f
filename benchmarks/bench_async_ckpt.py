"""The training loop's stall per checkpoint save: synchronous, asynchronous, and torch DCP.

Run: PYTHONPATH=$PWD python benchmarks/bench_async_ckpt.py [--sizes 30m,300m] [--saves 6]
     [--savers sync,async,dcp] [--world-size 2] [--root /tmp]

On ``--world-size`` gloo ranks (CPU), per GPT size (``benchmarks/gpt.py``; ``100m`` and
``300m`` are defined here), each of three savers in turn trains AdamW one step, then saves
``--saves`` times with one training step after each save:

* ``sync``: ``shardwrap.save_checkpoint`` (ZeRO-3, one unit per block);
* ``async``: the same with ``asynchronous=True`` (each save first waits for the last);
* ``dcp``: ``torch.distributed.checkpoint.async_save`` (its default stager) of the model's
  and optimizer's state dicts (``get_state_dict``, inside the timed call), torch FSDP2
  (``fully_shard`` per block, then the root, as ``benchmarks/impls.py``'s ``_fsdp2``),
  waiting for the previous save's future first.

The stall of a save is the wall time of the call, the slowest rank's; saves are spaced
so that the previous one has finished (its wait is not timed, and its folder is removed).
Right before each save every rank measures its host memcpy bandwidth (best of 3 copies of
256 MiB between two warm buffers), so each save has its own physical floor: the bytes of
the rank's state (parameter shards and optimizer state) over that bandwidth, the slowest
rank's. Printed per saver: the first save's stall (it allocates the staging buffers), the
median and range of the later ones, the median of their ratios to their floors and that
ratio's range, the median time of the training step right after a save (it runs beside
the background write) and of the save's call until it has finished plus that step; and
``/proc/loadavg`` before and after each size (timings on a loaded machine mean little).
"""

from __future__ import annotations

import argparse
import gc
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

SIZES = {
    **gpt.SIZES,
    "100m": gpt.GPTConfig(vocab=1024, dim=1024, depth=8, num_heads=16, seq=64),
    "300m": gpt.GPTConfig(vocab=1024, dim=1024, depth=24, num_heads=16, seq=64),  # 304M
}
SAVERS = ("sync", "async", "dcp")
BATCH = 2
MEMCPY_BYTES = 256 << 20


class Memcpy:
    """Two warm host buffers: this rank's memcpy bandwidth, measured on demand."""

    def __init__(self) -> None:
        self.source = torch.ones(MEMCPY_BYTES // 4)
        self.target = torch.zeros_like(self.source)

    def bandwidth(self, repeats: int = 3) -> float:
        """Bytes per second of a host-to-host tensor copy (best of ``repeats``, 256 MiB)."""
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            self.target.copy_(self.source)
            best = min(best, time.perf_counter() - started)
        return MEMCPY_BYTES / best


def load_average() -> str:
    with open("/proc/loadavg", encoding="ascii") as handle:
        return " ".join(handle.read().split()[:3])


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


def measure(kind: str, config: gpt.GPTConfig, saves: int, root: str, memcpy: Memcpy) -> dict:
    model, optimizer = build(kind, config)
    train_step(model, optimizer, config, 0)  # the optimizer's state exists from here
    saver = Saver(kind, model, optimizer)
    num_bytes = state_bytes(optimizer)
    stalls, floors, steps, totals = [], [], [], []
    for index in range(saves):
        saver.finish()  # saves far enough apart that the last one is done (not timed)
        if index and dist.get_rank() == 0:
            shutil.rmtree(os.path.join(root, kind, f"save{index - 1}"), ignore_errors=True)
        dist.barrier()
        floors.append(num_bytes / memcpy.bandwidth())
        dist.barrier()
        started = time.perf_counter()
        saver.save(os.path.join(root, kind, f"save{index}"))
        stalls.append(time.perf_counter() - started)
        steps.append(train_step(model, optimizer, config, index + 1))
        saver.finish()
        totals.append(time.perf_counter() - started)
    dist.barrier()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (stalls, floors, totals, num_bytes))
    slowest = [max(rank[0][i] for rank in every) for i in range(saves)]
    total = statistics.median(max(rank[2][i] for rank in every) for i in range(saves))
    del model, optimizer, saver
    gc.collect()  # the model's staging arena goes with it, before the next saver's model
    return {
        "stalls": slowest,
        "floors": [max(rank[1][i] for rank in every) for i in range(saves)],
        "step": statistics.median(steps),
        "total": total,
        "bytes": max(rank[3] for rank in every),
    }


def rank_main(rank: int, world_size: int, init: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    memcpy = Memcpy()
    for size in args.sizes.split(","):
        root = tempfile.mkdtemp(dir=args.root) if rank == 0 else ""
        holder = [root]
        dist.broadcast_object_list(holder)
        root = holder[0]
        kinds = args.savers.split(",")
        before = load_average()
        rows = {kind: measure(kind, SIZES[size], args.saves, root, memcpy) for kind in kinds}
        if rank == 0:
            report(size, rows, world_size, before, load_average())
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    dist.destroy_process_group()


def _later(values: list[float]) -> list[float]:
    """The saves after the first (which allocates), or the first if it is the only one."""
    return values[1:] or values


def report(size: str, rows: dict, world_size: int, before: str, after: str) -> None:
    any_row = next(iter(rows.values()))
    floor = statistics.median(_later(any_row["floors"]))
    print(
        f"\n{size} GPT, {world_size} ranks, {any_row['bytes'] / 2**20:.0f} MiB of state per "
        f"rank, memcpy {any_row['bytes'] / floor / 2**30:.1f} GiB/s (median), floor "
        f"{floor * 1e3:.0f} ms; load average {before} before, {after} after"
    )
    print(
        f"{'saver':>6} {'first ms':>9} {'median ms':>10} {'range ms':>13} {'x floor':>8} "
        f"{'x range':>11} {'step ms':>8} {'save+step ms':>13}"
    )
    for kind, row in rows.items():
        later = _later(row["stalls"])
        ratios = _ratios(row)
        spread = f"{min(later) * 1e3:.0f}-{max(later) * 1e3:.0f}"
        ratio_spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(
            f"{kind:>6} {row['stalls'][0] * 1e3:9.0f} {statistics.median(later) * 1e3:10.0f} "
            f"{spread:>13} {statistics.median(ratios):8.2f} {ratio_spread:>11} "
            f"{row['step'] * 1e3:8.0f} {row['total'] * 1e3:13.0f}"
        )
    if "async" in rows and "dcp" in rows:
        ratio = statistics.median(_later(rows["async"]["stalls"]))
        ratio /= statistics.median(_later(rows["dcp"]["stalls"]))
        # The savers run one after the other: on a machine whose load changes meanwhile,
        # the ratio of their stalls to their own floors is the fairer comparison.
        normalised = statistics.median(_ratios(rows["async"]))
        normalised /= statistics.median(_ratios(rows["dcp"]))
        print(f"async / dcp median stall: {ratio:.2f}; of their x floor: {normalised:.2f}")


def _ratios(row: dict) -> list[float]:
    """Each later save's stall over its own floor."""
    return _later([s / f for s, f in zip(row["stalls"], row["floors"], strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="30m", help=f"comma list of {sorted(SIZES)}")
    parser.add_argument("--saves", type=int, default=6)
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
