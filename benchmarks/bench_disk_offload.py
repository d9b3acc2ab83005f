"""Resident memory and step time with DiskOffload vs in memory (one rank, CPU).

Run: PYTHONPATH=$PWD python benchmarks/bench_disk_offload.py [--dim 2048 --layers 6]
Prints the process's resident memory split (anonymous vs file-backed) after training.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import shardwrap


def rss_kib() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem")):
                name, value = line.split(":")
                fields[name] = int(value.split()[0])
    return fields


def run(dim: int, layers: int, steps: int, offload_dir: str | None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    offload = shardwrap.DiskOffload(offload_dir) if offload_dir else None
    sharded = shardwrap.ShardedModule(model, cpu_offload=offload)
    optim = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    x = torch.randn(8, dim)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        sharded(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        times.append(time.perf_counter() - start)
    memory = rss_kib()
    del sharded, optim, model
    gc.collect()
    return {"step_s": sorted(times[1:])[len(times[1:]) // 2], **memory}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--mode", choices=["memory", "disk"], required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=0, world_size=1)
        scratch = tempfile.mkdtemp(dir=tmp) if args.mode == "disk" else None
        result = run(args.dim, args.layers, args.steps, scratch)
        dist.destroy_process_group()
    params = args.layers * (args.dim * args.dim + args.dim)
    print(
        f"{args.mode}: {params / 1e6:.1f}M params, median step {result['step_s']:.3f}s, "
        f"VmRSS {result['VmRSS'] / 1024:.0f} MiB (anon {result['RssAnon'] / 1024:.0f}, "
        f"file {result['RssFile'] / 1024:.0f}, shmem {result['RssShmem'] / 1024:.0f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
