"""Losses of every shardwrap strategy against DDP's, step by step, per optimizer path.

The numerics side of the benchmark: a speed change that breaks training shows here as a
row that is not identical to DDP's. In one process pair, for each model size and each
optimizer implementation (``benchmarks/optimizers.py``), DDP and every strategy train
from the same weights on the same batches; the table prints each step's mean loss and
whether the row, and the full parameters after the last step, equal DDP's bit for bit::

    PYTHONPATH=$PWD python benchmarks/bench_parity.py --sizes 5m,30m \\
        --optimizers adamw_foreach,adamw_fused,adamw_loop --steps 7

At 2 ranks every strategy must print ``identical``; a hybrid runs with one-rank shard
groups there (its replica all-reduce carries the sum). Exits 1 if any row differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpt  # noqa: E402
from benchmarks.cli import comma_list  # noqa: E402
from benchmarks.optimizers import OPTIMIZERS  # noqa: E402
from benchmarks.parity import STRATEGIES, differences, train  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="5m,30m", help=f"comma list of {sorted(gpt.SIZES)}")
    parser.add_argument(
        "--optimizers",
        default="adamw_foreach,adamw_fused,adamw_loop",
        help=f"comma list of {sorted(OPTIMIZERS)}",
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    args.sizes = comma_list(parser, "--sizes", args.sizes, gpt.SIZES, "size")
    args.optimizers = comma_list(parser, "--optimizers", args.optimizers, OPTIMIZERS, "optimizer")
    args.strategies = comma_list(parser, "--strategies", args.strategies, STRATEGIES, "strategy")
    return args


def _table(size: str, optimizer: str, rows: dict[str, tuple[list[float], list[str]]]) -> str:
    steps = len(next(iter(rows.values()))[0])
    lines = [f"\n{size}, {optimizer}: mean loss per step"]
    lines.append(f"{'impl':<20}" + "".join(f"{s + 1:>10}" for s in range(steps)) + "   vs DDP")
    for impl, (losses, found) in rows.items():
        verdict = "-" if impl == "DDP" else ("identical" if not found else "DIFFERS: " + found[0])
        lines.append(f"{impl:<20}" + "".join(f"{x:>10.5f}" for x in losses) + f"   {verdict}")
    return "\n".join(lines)


def _worker(rank: int, args: argparse.Namespace, init_file: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world_size
    )
    num_differing = 0
    try:
        for size in args.sizes:
            for name in args.optimizers:
                options = dict(num_steps=args.steps, batch_size=args.micro_batch)
                reference = train(gpt.SIZES[size], "DDP", OPTIMIZERS[name], **options)
                rows = {"DDP": (reference.losses, [])}
                for strategy in args.strategies:
                    run = train(
                        gpt.SIZES[size], strategy, OPTIMIZERS[name], hybrid_shard_size=1, **options
                    )
                    rows[strategy] = (run.losses, differences(run, reference, tolerance=None))
                    num_differing += bool(rows[strategy][1])
                if rank == 0:
                    print(_table(size, name, rows), flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.put(num_differing)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, os.path.join(tmp, "init"), results), nprocs=args.world_size)
    num_differing = results.get()
    print(f"\n{num_differing} row(s) differ from DDP")
    return 1 if num_differing else 0


if __name__ == "__main__":
    sys.exit(main())
