"""Resident memory and step time with DiskOffload vs in memory (one rank, CPU).

Run: PYTHONPATH=$PWD python benchmarks/bench_disk_offload.py --mode memory|disk
     [--sub-group-size N] [--threads N] [--dim 2048 --layers 6 --steps 6]
Prints, per mode: the median time of a whole iteration (forward, backward, step) and of
``optimizer.step()`` alone (wall and process CPU time); the resident set after training
(anonymous vs file-backed); and the peak resident set (VmHWM, restarted through
/proc/self/clear_refs) during the last iteration and during its optimizer step, each also
as the rise over the resident set just before. Run the modes as separate processes,
interleaved, and compare medians.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import shardwrap


def status_kib() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")):
                name, value = line.split(":")
                fields[name] = int(value.split()[0])
    return fields


def restart_peak() -> int:
    """Restart VmHWM at the current resident set (Linux >= 4.0); returns that set in KiB."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return status_kib()["VmRSS"]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(dim: int, layers: int, steps: int, offload: shardwrap.DiskOffload | None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    sharded = shardwrap.ShardedModule(model, cpu_offload=offload)
    optim = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    x = torch.randn(8, dim)
    times, step_times, step_cpu, peaks = [], [], [], {}
    for _ in range(steps):
        iteration_base = restart_peak()
        start = time.perf_counter()
        sharded(x).square().mean().backward()
        before_step = status_kib()
        peaks["iteration_to_step"] = before_step["VmHWM"]
        step_base = restart_peak()
        step_start, cpu_start = time.perf_counter(), cpu_seconds()
        optim.step()
        step_times.append(time.perf_counter() - step_start)
        step_cpu.append(cpu_seconds() - cpu_start)
        peaks["step"] = status_kib()["VmHWM"]
        peaks["step_rise"] = peaks["step"] - step_base
        peaks["iteration"] = max(peaks["iteration_to_step"], peaks["step"])
        peaks["iteration_rise"] = peaks["iteration"] - iteration_base
        optim.zero_grad()
        times.append(time.perf_counter() - start)
    groups = sharded.disk_store.num_sub_groups(optim) if sharded.disk_store else 0
    memory = status_kib()
    del sharded, optim, model
    gc.collect()
    return {
        "step_s": statistics.median(times[1:]),
        "optimizer_step_s": statistics.median(step_times[1:]),
        "optimizer_step_cpu_s": statistics.median(step_cpu[1:]),
        "sub_groups": groups,
        **{f"peak_{k}": v for k, v in peaks.items()},
        **memory,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--mode", choices=["memory", "disk"], required=True)
    parser.add_argument("--sub-group-size", type=int, default=1_000_000_000)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=0, world_size=1)
        offload = None
        if args.mode == "disk":
            offload = shardwrap.DiskOffload(tempfile.mkdtemp(dir=tmp), args.sub_group_size)
        result = run(args.dim, args.layers, args.steps, offload)
        dist.destroy_process_group()
    params = args.layers * (args.dim * args.dim + args.dim)
    label = args.mode if offload is None else f"disk sub_group_size={args.sub_group_size:g}"
    mib = {k: v / 1024 for k, v in result.items() if k.startswith(("peak", "Vm", "Rss"))}
    print(
        f"{label}: {params / 1e6:.1f}M params, {result['sub_groups']} sub-group(s), "
        f"median iteration {result['step_s']:.3f}s, "
        f"optimizer.step {result['optimizer_step_s']:.3f}s "
        f"(CPU {result['optimizer_step_cpu_s']:.3f}s), {torch.get_num_threads()} thread(s)"
    )
    print(
        f"  peak during step {mib['peak_step']:.0f} MiB (+{mib['peak_step_rise']:.0f} over "
        f"its start), during iteration {mib['peak_iteration']:.0f} MiB "
        f"(+{mib['peak_iteration_rise']:.0f})"
    )
    print(
        f"  after: VmRSS {mib['VmRSS']:.0f} MiB (anon {mib['RssAnon']:.0f}, "
        f"file {mib['RssFile']:.0f}, shmem {mib['RssShmem']:.0f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
