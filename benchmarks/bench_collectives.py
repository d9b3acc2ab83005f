"""shardwrap's gloo all-gather and reduce-scatter against torch's, wall and CPU time.

    PYTHONPATH=$PWD python benchmarks/bench_collectives.py --numel 5000000 --ranks 2

Each rank runs every variant ``--repeats`` times after a barrier and reports the median
wall time of the call-and-wait and the median CPU time of its process (every thread:
gloo's own threads included). Rank 0 prints the table. shardwrap's variants go through
``Communicator`` as training does (pairwise exchanges on gloo, see
[Note: pairwise collectives on gloo]); torch's are ``all_gather_single``,
``reduce_scatter_single`` and the ``all_reduce`` its gloo reduce-scatter amounts to. Every
variant's result is compared with torch's before timing, so a fast wrong answer cannot
hide in the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardwrap.comm.collectives import CommLedger, Communicator  # noqa: E402


def _variants(comm: Communicator, full: torch.Tensor, shard: torch.Tensor):
    """name -> (call that runs one collective to completion, its result)."""
    gathered = torch.empty_like(full)
    scattered = torch.empty_like(shard)
    reduced = torch.empty_like(full)
    return {
        "all_gather torch": (
            lambda: dist.all_gather_single(gathered, shard),
            gathered,
        ),
        "all_gather shardwrap": (
            lambda: comm.all_gather(gathered, shard, purpose="bench").wait(),
            gathered,
        ),
        "all_reduce torch": (
            lambda: dist.all_reduce(reduced.copy_(full)),
            reduced,
        ),
        "reduce_scatter torch": (
            lambda: dist.reduce_scatter_single(scattered, full),
            scattered,
        ),
        "reduce_scatter shardwrap": (
            lambda: comm.reduce_scatter(scattered, full, purpose="bench").wait(),
            scattered,
        ),
    }


def measure(rank: int, world_size: int, numel: int, repeats: int) -> dict[str, dict]:
    """Run every variant on this rank; returns name -> {wall_ms, cpu_ms, matches_torch}."""
    numel -= numel % world_size
    generator = torch.Generator().manual_seed(rank)
    full = torch.randn(numel, generator=generator)
    shard = full[: numel // world_size].clone()
    comm = Communicator(dist.group.WORLD, CommLedger())
    variants = _variants(comm, full, shard)
    reference: dict[str, torch.Tensor] = {}
    results = {}
    for name, (run, result) in variants.items():
        run()
        kind = name.split()[0]
        if name.endswith("torch"):
            reference[kind] = result.clone()
        walls, cpus = [], []
        for _ in range(repeats):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        results[name] = {
            "wall_ms": 1e3 * statistics.median(walls),
            "cpu_ms": 1e3 * statistics.median(cpus),
            "matches_torch": _close(result, reference[kind]),
        }
    return results


def _close(result: torch.Tensor, reference: torch.Tensor) -> bool:
    """Equal up to the summation order (assert_close's float32 defaults): from three ranks
    on, torch's ring and shardwrap's rank order add the same numbers in another order."""
    try:
        torch.testing.assert_close(result, reference)
    except AssertionError:
        return False
    return True


def _worker(rank: int, world_size: int, init_file: str, numel: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        results = measure(rank, world_size, numel, repeats)
        if rank == 0:
            print(f"{numel:,} fp32 elements, {world_size} ranks, medians of {repeats}")
            print(f"{'variant':<26}{'wall ms':>9}{'CPU ms':>9}  same result as torch")
            for name, row in results.items():
                print(
                    f"{name:<26}{row['wall_ms']:>9.2f}{row['cpu_ms']:>9.2f}  {row['matches_torch']}"
                )
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=5_000_000, help="elements of the full buffer")
    parser.add_argument("--ranks", type=int, default=2, help="processes (gloo, CPU)")
    parser.add_argument("--repeats", type=int, default=11, help="timed calls per variant")
    args = parser.parse_args(argv)
    for name in ("numel", "ranks", "repeats"):
        if getattr(args, name) < (2 if name == "ranks" else 1):
            parser.error(f"--{name} is too small: {getattr(args, name)}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _worker,
            args=(args.ranks, os.path.join(tmp, "rendezvous"), args.numel, args.repeats),
            nprocs=args.ranks,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
