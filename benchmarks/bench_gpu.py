"""One device, one process: shardwrap FULL_SHARD against PyTorch FSDP2 on the GPT.

Run on a GPU (NCCL, one rank):

    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --size 124m --dtype bfloat16

It prints, per implementation, tokens per second (median step), peak device memory
(``torch.cuda.max_memory_allocated``) and the losses of every step, then the ratios and
the largest loss difference. Implementations run one after the other, each from the same
initial weights and batches, with the peak-memory counter reset in between. On a machine
without a GPU, ``--device cpu`` runs the same code on gloo as a smoke test (no memory
figure; CPU timings say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpt  # noqa: E402
from benchmarks.cli import comma_list  # noqa: E402

# A GPT-2-small-like shape for the GPU run; the CPU sizes come from gpt.SIZES.
GPU_SIZES = {"124m": gpt.GPTConfig(vocab=50304, dim=768, depth=12, num_heads=12, seq=1024)}
LEARNING_RATE = 3e-4


def _precision(dtype: torch.dtype):
    """(shardwrap policy, FSDP2 policy) for ``dtype``; both None in fp32."""
    if dtype == torch.float32:
        return None, None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import shardwrap

    return (
        shardwrap.MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32),
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
    )


def wrap_shardwrap(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    import shardwrap
    from shardwrap.policies import ModuleWrapPolicy

    policy, _ = _precision(dtype)
    return shardwrap.ShardedModule(
        model,
        auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
        mixed_precision=policy,
        device_id=device,
        forward_prefetch=True,
    )


def wrap_fsdp2(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, policy = _precision(dtype)
    extra = {} if policy is None else {"mp_policy": policy}
    mesh = init_device_mesh(device.type, (1,))
    model.to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    return model


def plain(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The unwrapped model: the reference (fp32 only; it has no mixed precision)."""
    if dtype != torch.float32:
        raise ValueError("--impls plain: the unwrapped reference runs in float32 only")
    return model.to(device)


IMPLS: dict[str, Callable[[nn.Module, torch.device, torch.dtype], nn.Module]] = {
    "shardwrap": wrap_shardwrap,
    "fsdp2": wrap_fsdp2,
    "plain": plain,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(name: str, config: gpt.GPTConfig, args, device: torch.device) -> dict:
    """Train ``args.warmup + args.steps`` steps; median time, peak memory, losses."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = IMPLS[name](gpt.build(config), device, args.dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        inputs, targets = (
            t.to(device) for t in gpt.batch(config, step=step, rank=0, batch_size=args.batch)
        )
        _sync(device)
        start = time.perf_counter()
        loss = gpt.loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    median = sorted(times)[len(times) // 2]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, optimizer
    return {
        "median_s": median,
        "tokens_per_s": args.batch * config.seq / median,
        "peak_bytes": peak,
        "losses": losses,
    }


def report(results: dict[str, dict]) -> str:
    lines = [f"{'impl':<10} {'tokens/s':>12} {'median ms':>10} {'peak MiB':>10}"]
    for name, r in results.items():
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        lines.append(
            f"{name:<10} {r['tokens_per_s']:>12.0f} {r['median_s'] * 1e3:>10.1f} {peak:>10}"
        )
    if {"shardwrap", "fsdp2"} <= results.keys():
        ours, theirs = results["shardwrap"], results["fsdp2"]
        lines.append(
            f"tokens/s shardwrap / fsdp2: {ours['tokens_per_s'] / theirs['tokens_per_s']:.3f}"
        )
        if ours["peak_bytes"] is not None:
            lines.append(
                f"peak memory shardwrap / fsdp2: {ours['peak_bytes'] / theirs['peak_bytes']:.3f}"
            )
        diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
        lines.append(f"largest loss difference: {diff:.3e}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None):
    sizes = {**gpt.SIZES, **GPU_SIZES}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", default="124m", choices=sorted(sizes))
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--impls", default="shardwrap,fsdp2", help=f"comma list of {list(IMPLS)}")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    args.config = sizes[args.size]
    args.dtype = getattr(torch, args.dtype)
    args.impls = comma_list(parser, "--impls", args.impls, IMPLS, "implementation")
    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        parser.error("--steps and --batch must be at least 1, --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/rdv", rank=0, world_size=1)
        try:
            results = {name: run_one(name, args.config, args, device) for name in args.impls}
        finally:
            dist.destroy_process_group()
    print(
        f"{args.size} GPT, {sum(p.numel() for p in gpt.build(args.config).parameters()):,} "
        f"parameters, {args.dtype}, batch {args.batch} x {args.config.seq}, {device}"
    )
    print(report(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
