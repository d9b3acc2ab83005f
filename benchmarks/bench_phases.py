"""Forward, backward and optimizer time of several implementations in one process pair.

``bench_step.py`` gives every implementation its own processes, so a few percent between
two of them mixes the implementations' work with each process's allocator history
(benchmarks/RESULTS.md, run 13). Here every implementation lives in the same ranks and
their steps alternate, so they share the heap, the caches and the machine's drift; each
phase of each step is timed on its own (after a barrier, slower rank counts)::

    PYTHONPATH=$PWD python benchmarks/bench_phases.py --impls ddp,sw_no_shard --steps 100

Prints per-phase medians, each implementation's ratio to the first one named, and
whether its losses equal that one's. Several shardwrap variants share a process here, so
the ``*_inline_posts`` ones, which flip a process-wide switch, are refused.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpt  # noqa: E402
from benchmarks.impls import IMPLS  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "step")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="5m", choices=sorted(gpt.SIZES))
    parser.add_argument("--impls", default="ddp,sw_no_shard", help="comma list; first = base")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args(argv)
    args.impls = [i for i in args.impls.split(",") if i]
    for impl in args.impls:
        if impl not in IMPLS or IMPLS[impl].family not in ("shardwrap", "ddp", "fsdp1", "fsdp2"):
            parser.error(f"--impls: {impl!r} is not a torch or shardwrap implementation")
        if impl.endswith("_inline_posts"):
            parser.error(f"--impls: {impl!r} changes a process-wide switch; use bench_step.py")
    if not args.impls or args.steps < 1 or args.warmup < 0 or args.world_size < 1:
        parser.error("--impls must name one; --steps, --world-size >= 1; --warmup >= 0")
    return args


class _GcClock:
    """Seconds spent in the cyclic garbage collector, while installed as a ``gc.callbacks``
    entry (``with _GcClock() as clock``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> _GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def _timed(fn, costs: dict[str, float], phase: str, clock: _GcClock) -> tuple[object, float]:
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    gc_before = clock.seconds
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    costs[f"faults_{phase}"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    costs[f"gc_{phase}"] = clock.seconds - gc_before
    return out, elapsed


def _one_step(trainer, inputs, targets, clock: _GcClock) -> dict[str, float]:
    """One training step's phase times (s), page faults and gc time, and its loss."""
    record: dict[str, float] = {}
    trainer.optimizer.zero_grad()
    loss, record["forward"] = _timed(
        lambda: gpt.loss_fn(trainer.model(inputs), targets), record, "forward", clock
    )
    _, record["backward"] = _timed(loss.backward, record, "backward", clock)
    _, record["optimizer"] = _timed(trainer.optimizer.step, record, "optimizer", clock)
    record["loss"] = float(loss.detach())
    return record


def measure(
    rank: int, world_size: int, size: str, impls: list[str], steps: int, warmup: int, batch: int
) -> dict[str, dict]:
    """Run the interleaved steps on this rank (process group initialised); the summary,
    the same on every rank: per implementation, phase medians (ms, slower rank per step),
    rank 0's mean page faults and gc ms per phase, and the loss of every timed step."""
    config = gpt.SIZES[size]
    trainers = {
        impl: IMPLS[impl].build(gpt.build(config), micro_batch=batch, world_size=world_size)
        for impl in impls
    }
    records: dict[str, list[dict[str, float]]] = {impl: [] for impl in impls}
    with _GcClock() as clock:
        for index in range(warmup + steps):
            inputs, targets = gpt.batch(config, step=index, rank=rank, batch_size=batch)
            # Rotate the order so no implementation always runs right after another one.
            order = impls[index % len(impls) :] + impls[: index % len(impls)]
            for impl in order:
                record = _one_step(trainers[impl], inputs, targets, clock)
                if index >= warmup:
                    records[impl].append(record)
    by_rank: list = [None] * world_size
    dist.all_gather_object(by_rank, records)
    return {impl: _summarize([r[impl] for r in by_rank]) for impl in impls}


def _summarize(per_rank: list[list[dict[str, float]]]) -> dict:
    steps = list(zip(*per_rank))  # each: one step's records, by rank
    medians = {
        phase: 1e3 * statistics.median(max(r[phase] for r in step) for step in steps)
        for phase in PHASES[:3]
    }
    medians["step"] = 1e3 * statistics.median(
        max(sum(r[p] for p in PHASES[:3]) for r in step) for step in steps
    )
    rank0 = per_rank[0]
    return {
        "median_ms": medians,
        "faults": {p: statistics.mean(r[f"faults_{p}"] for r in rank0) for p in PHASES[:3]},
        "gc_ms": {p: 1e3 * statistics.mean(r[f"gc_{p}"] for r in rank0) for p in PHASES[:3]},
        "losses": [r["loss"] for r in rank0],
    }


def _worker(rank: int, args: argparse.Namespace, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world_size
    )
    try:
        summary = measure(
            rank, args.world_size, args.size, args.impls, args.steps, args.warmup, args.micro_batch
        )
        if rank == 0:
            print(report(summary, args))
    finally:
        dist.destroy_process_group()


def report(summary: dict[str, dict], args: argparse.Namespace) -> str:
    base = args.impls[0]
    lines = [
        f"{args.size}, {args.world_size} ranks, {args.steps} interleaved steps; median ms",
        f"{'impl':<22}"
        + "".join(f"{p:>11}" for p in PHASES)
        + f"{'/' + base:>12}   rank 0 per step (fwd/bwd/opt): page faults; gc ms; same losses",
    ]
    for impl in args.impls:
        row = summary[impl]
        medians = "".join(f"{row['median_ms'][p]:>11.2f}" for p in PHASES)
        ratio = row["median_ms"]["step"] / summary[base]["median_ms"]["step"]
        faults = "/".join(f"{row['faults'][p]:.0f}" for p in PHASES[:3])
        collected = "/".join(f"{row['gc_ms'][p]:.2f}" for p in PHASES[:3])
        same = row["losses"] == summary[base]["losses"]
        lines.append(f"{impl:<22}{medians}{ratio:>12.3f}   {faults}; {collected}; {same}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, os.path.join(tmp, "init")), nprocs=args.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
