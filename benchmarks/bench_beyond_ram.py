"""Train a GPT whose fp32 masters and Adam state exceed the machine's RAM, on disk (ZeRO-3).

Run (the full size, about 2.5B parameters and 40 GB of model state; see RESULTS.md):
    PYTHONPATH=$PWD python benchmarks/bench_beyond_ram.py --offload-dir /tmp/offload \
        --data-limit-gib 6 [--save /tmp/ckpt --consolidate /tmp/hf]
Medium scale: ``--dim 1024 --depth 12 --heads 16`` (0.22B parameters), ``--dim 2048 --depth 5
--heads 16`` (0.38B).

Two CPU ranks (gloo), each one process. The model is built on the meta device and
materialised one unit (a block, an embedding, the head) at a time straight into the
disk store; bf16 compute, fp32 masters, gradients handed to the optimizer and AdamW
state in mapped files (``DiskOffload``), activation checkpointing in every block. Three
steps on one fixed batch. Per step and rank: the loss, the time of forward, backward and
``optimizer.step()``, the peak resident set (VmHWM, restarted each step) and the bytes
read and written on disk (/proc/self/io). At the end the planner's resident peak for the
same configuration (``python -m shardwrap estimate --offload nvme``) beside the measured
one. ``--door deepspeed`` runs the same through ``shardwrap.initialize`` with
``offload_param``/``offload_optimizer`` ``{device: nvme}`` (and DeepSpeed's default gradient
clipping at 1.0). ``--save``/``--consolidate``: then ``save_checkpoint`` and
``python -m shardwrap consolidate`` into a Hugging Face folder, with their peaks.

``--data-limit-gib``: RLIMIT_DATA of each rank, a guard that makes a run which would
swap fail instead (anonymous memory only: the mapped files do not count against it).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

import shardwrap
from benchmarks import gpt

GIB = 2**30


class CheckpointedBlock(gpt.Block):
    """A block whose activations are recomputed in backward (only its input is kept)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


class BigGPT(gpt.GPT):
    def __init__(self, config: gpt.GPTConfig) -> None:
        super().__init__(config)
        self.blocks = torch.nn.ModuleList(
            CheckpointedBlock(config.dim, config.num_heads) for _ in range(config.depth)
        )


def unit_policy(model: BigGPT):
    """A unit per block, per embedding and for the head: the root keeps only the last norm."""

    def policy(module: torch.nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        kinds = (gpt.Block, torch.nn.Embedding)
        return recurse or isinstance(module, kinds) or module is model.head

    return policy


def status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def restart_peak() -> None:
    """Restart VmHWM at the current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def disk_io() -> tuple[int, int]:
    """(bytes read from, bytes written to) the block layer by this process so far."""
    fields = {}
    with open("/proc/self/io") as io:
        for line in io:
            name, value = line.split(":")
            fields[name] = int(value)
    return fields["read_bytes"], fields["write_bytes"]


class Meter:
    """Peak resident set and disk bytes of one phase."""

    def __init__(self) -> None:
        restart_peak()
        self.io = disk_io()
        self.start = time.perf_counter()

    def done(self) -> dict:
        read, written = disk_io()
        return {
            "s": time.perf_counter() - self.start,
            "peak": status_kib("VmHWM") * 1024,
            "read": read - self.io[0],
            "written": written - self.io[1],
        }


def config_of(args) -> gpt.GPTConfig:
    return gpt.GPTConfig(
        vocab=args.vocab, dim=args.dim, depth=args.depth, num_heads=args.heads, seq=args.seq
    )


def build_model(args) -> BigGPT:
    """The model on the meta device: no storage until ShardedModule materialises each unit."""
    with torch.device("meta"):
        return BigGPT(config_of(args))


def wrap(args, model, offload_dir: str):
    """(forward, backward, step, wrapped model, optimizer), through ``ShardedModule`` or
    ``initialize``."""
    if args.door == "deepspeed":
        nvme = {"device": "nvme", "nvme_path": offload_dir}
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": nvme,
                "offload_optimizer": nvme,
                "sub_group_size": args.sub_group_size,
            },
        }
        engine, optim, _, _ = shardwrap.initialize(
            model=model, config=config, auto_wrap_policy=unit_policy(model)
        )
        return engine, engine.backward, engine.step, engine.module, optim
    sharded = shardwrap.ShardedModule(
        model,
        auto_wrap_policy=unit_policy(model),
        cpu_offload=shardwrap.DiskOffload(offload_dir, sub_group_size=args.sub_group_size),
        mixed_precision=shardwrap.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
        ),
    )
    optim = torch.optim.AdamW(sharded.parameters(), lr=args.lr, weight_decay=0.0)

    def step() -> None:
        optim.step()
        optim.zero_grad()

    return sharded, lambda loss: loss.backward(), step, sharded, optim


def train(rank: int, args) -> dict:
    """Build, train ``args.steps`` steps, save: the measurements of this rank."""
    report: dict = {"steps": [], "process": status_kib("VmRSS") * 1024}
    meter = Meter()
    torch.manual_seed(0)
    forward, backward, step, sharded, optim = wrap(args, build_model(args), args.offload_dir)
    report["init"] = meter.done()
    print(f"rank {rank} init: {report['init']}", flush=True)
    report["num_params"] = sum(p.numel() for p in sharded.parameters())
    inputs, targets = gpt.batch(config_of(args), step=0, rank=rank, batch_size=args.batch)
    for _ in range(args.steps):
        meter = Meter()
        loss = gpt.loss_fn(forward(inputs).float(), targets)
        fwd = meter.done()
        backward(loss)
        bwd = meter.done()
        meter = Meter()  # the step's own peak
        step()
        stepped = meter.done()
        report["steps"].append(
            {
                "loss": loss.item(),
                "fwd_s": fwd["s"],
                "bwd_s": bwd["s"] - fwd["s"],
                "step_s": stepped["s"],
                "train_peak": bwd["peak"],  # forward and backward
                "step_peak": stepped["peak"],
                "peak": max(bwd["peak"], stepped["peak"]),
                "read": bwd["read"] + stepped["read"],
                "written": bwd["written"] + stepped["written"],
            }
        )
        print(f"rank {rank} step {len(report['steps']) - 1}: {report['steps'][-1]}", flush=True)
    if args.save:
        from shardwrap.checkpoint import save_checkpoint

        meter = Meter()
        save_checkpoint(args.save, sharded, optim)
        report["save"] = meter.done()
    report["vm_data"] = status_kib("VmData") * 1024
    return report


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>


def fixed_malloc_thresholds(num_bytes: int) -> None:
    """glibc: serve blocks from ``num_bytes`` up with their own mapping, returned when freed.

    By default glibc raises that threshold to the largest block freed so far (up to 32 MiB),
    after which such blocks come from the heap, which keeps what fragmentation strands: on
    the 217M model about 300 MiB per rank after init. A fixed threshold (set with mallopt)
    turns that adjustment off. The planner's process baseline assumes it.
    """
    libc = ctypes.CDLL(None)
    for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD):
        if libc.mallopt(option, num_bytes) != 1:
            raise OSError(f"mallopt({option}, {num_bytes}) failed")


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def rank_main(rank: int, args, init_file: str, queue) -> None:
    # End with the parent (killed by a timeout, say) instead of running on alone.
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if args.data_limit_gib:
        limit = int(args.data_limit_gib * GIB)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    torch.set_num_threads(args.threads)
    if args.malloc_threshold_mib:
        fixed_malloc_thresholds(args.malloc_threshold_mib << 20)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world_size
        )
        queue.put((rank, train(rank, args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(args) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=rank_main, args=(r, args, os.path.join(tmp, "rdv"), queue))
            for r in range(args.world_size)
        ]
        for proc in procs:
            proc.start()
        reports = dict(queue.get() for _ in procs)
        for proc in procs:
            proc.join()
    failed = {r: v for r, v in reports.items() if isinstance(v, str)}
    if failed:
        for rank, text in failed.items():
            print(f"rank {rank} failed:\n{text}", file=sys.stderr)
        raise SystemExit(1)
    return [reports[r] for r in range(args.world_size)]


def consolidate(args) -> dict:
    """``python -m shardwrap consolidate`` in a child process: its peak RSS and time."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "shardwrap", "consolidate", args.save, args.consolidate]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    if status != 0:
        raise SystemExit(f"consolidate failed with status {status}")
    return {"s": time.perf_counter() - start, "peak": usage.ru_maxrss * 1024}


def layer_params(dim: int) -> int:
    """A block's parameters: qkv and out projections, the MLP, their biases, two norms."""
    return 12 * dim * dim + 13 * dim


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f}"


def print_report(args, reports: list[dict]) -> None:
    print(
        f"{reports[0]['num_params'] * args.world_size / 1e9:.3f}B parameters (shards summed), "
        f"{args.world_size} ranks, door {args.door}, sub_group_size {args.sub_group_size:,}"
    )
    for rank, report in enumerate(reports):
        init = report["init"]
        print(
            f"rank {rank} init {init['s']:.1f}s peak {gib(init['peak'])} GiB "
            f"written {gib(init['written'])} GiB"
        )
    for index in range(args.steps):
        rows = [r["steps"][index] for r in reports]
        cells = " | ".join(
            f"r{rank} loss {s['loss']:.4f} fwd {s['fwd_s']:.1f}s bwd {s['bwd_s']:.1f}s "
            f"step {s['step_s']:.1f}s peak fwd+bwd {gib(s['train_peak'])} "
            f"step {gib(s['step_peak'])} GiB "
            f"read {gib(s['read'])} written {gib(s['written'])} GiB"
            for rank, s in enumerate(rows)
        )
        print(f"step {index}: {cells}")
    if args.save:
        for rank, report in enumerate(reports):
            save = report["save"]
            print(
                f"rank {rank} save {save['s']:.1f}s peak {gib(save['peak'])} GiB "
                f"written {gib(save['written'])} GiB"
            )
    vm_data = " / ".join(gib(r["vm_data"]) for r in reports)
    print(f"VmData at the end (RLIMIT_DATA counts it): {vm_data} GiB")
    measured = [max(s["peak"] for s in r["steps"]) for r in reports]
    from shardwrap.planner.resident import DiskRunShape

    shape = DiskRunShape(
        num_params=reports[0]["num_params"] * args.world_size,
        world_size=args.world_size,
        layer_params=layer_params(args.dim),
        hidden=args.dim,
        layers=args.depth,
        tokens_per_rank=args.batch * args.seq,
        vocab=args.vocab,
        sub_group_size=args.sub_group_size,
    )
    from shardwrap.planner.resident import resident_peak

    predicted = resident_peak(shape)
    print(f"process before the model: {' / '.join(gib(r['process']) for r in reports)} GiB")
    print(predicted.format())
    print(
        f"peak resident set per rank: measured {' / '.join(gib(m) for m in measured)} GiB, "
        f"planner {gib(predicted.total)} GiB ({predicted.describe()}); "
        f"sum of ranks {gib(sum(measured))} GiB"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=2560)
    parser.add_argument("--depth", type=int, default=30)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--sub-group-size", type=int, default=20_000_000)
    parser.add_argument("--door", choices=["shardwrap", "deepspeed"], default="shardwrap")
    parser.add_argument("--offload-dir", required=True, help="an existing directory on disk")
    parser.add_argument("--data-limit-gib", type=float, default=0.0, help="RLIMIT_DATA per rank")
    parser.add_argument(
        "--malloc-threshold-mib",
        type=int,
        default=1,
        help="fixed glibc mmap/trim threshold per rank (0: glibc's adaptive default)",
    )
    parser.add_argument("--save", default="", help="save_checkpoint here after training")
    parser.add_argument("--consolidate", default="", help="then consolidate into this HF folder")
    args = parser.parse_args(argv)
    if args.consolidate and not args.save:
        parser.error("--consolidate needs --save")
    return args


def main() -> int:
    args = parse_args()
    reports = run_ranks(args)
    print_report(args, reports)
    if args.consolidate:
        result = consolidate(args)
        print(f"consolidate {result['s']:.1f}s peak {gib(result['peak'])} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
