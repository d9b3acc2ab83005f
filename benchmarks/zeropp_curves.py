"""Loss curves of the benchmark GPT trained with each ZeRO++ technique against full precision.

Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/zeropp_curves.py                 # 1m GPT, 300 steps, 4 ranks
    PYTHONPATH=$PWD python benchmarks/zeropp_curves.py --size 5m --steps 100

Every run trains the same GPT (same seed, same per-rank batches, AdamW) under FULL_SHARD on
``--world-size`` gloo ranks on CPU, one ``CommQuantization`` per run (hpZ groups of two
ranks, so at least 4 ranks show it). Prints a table of losses at a few steps and each
run's largest relative difference from full precision over the last ``--tail`` steps;
writes every step's loss to ``--out`` (JSON). docs/zeropp.md records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpt  # noqa: E402
from benchmarks.impls import make_optimizer  # noqa: E402
from benchmarks.parity import train_losses  # noqa: E402

RUNS: dict[str, dict | None] = {
    "full precision": None,
    "qwZ (int8)": {"weights": True},
    "qgZ (int8)": {"gradients": True},
    "qgZ (int4)": {"gradients": True, "gradient_bits": 4},
    "hpZ (2 ranks)": {"hpz_partition_size": 2},
    "qwZ + qgZ + hpZ": {"weights": True, "gradients": True, "hpz_partition_size": 2},
}
MICRO_BATCH = 4


def _train(config: gpt.GPTConfig, quant: dict | None, steps: int) -> list[float]:
    import shardwrap
    from shardwrap.policies import ModuleWrapPolicy

    torch.manual_seed(0)
    model = shardwrap.ShardedModule(
        gpt.build(config),
        auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
        comm_quantization=shardwrap.CommQuantization(**quant) if quant else None,
    )
    optim = make_optimizer(model.parameters())
    return train_losses(model, optim, config, steps, MICRO_BATCH)


def _worker(rank: int, world_size: int, init_file: str, args, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    config = gpt.SIZES[args.size]
    curves = {}
    for name, quant in RUNS.items():
        hpz = quant.get("hpz_partition_size", 1) if quant else 1
        if world_size % hpz or hpz >= world_size and hpz > 1:
            continue  # hpZ needs groups smaller than the world
        curves[name] = _train(config, quant, args.steps)
        if rank == 0:
            print(f"{name}: done, last loss {curves[name][-1]:.4f}", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"size": args.size, "world_size": world_size, "curves": curves}, f)
    dist.destroy_process_group()


def table(curves: dict[str, list[float]], tail: int) -> str:
    plain = curves["full precision"]
    marks = sorted({1, len(plain) // 3, 2 * len(plain) // 3, len(plain)})
    head = " | ".join(f"step {m}" for m in marks)
    lines = [
        f"| run | {head} | max rel. diff, last {tail} steps |",
        "|---" * (len(marks) + 2) + "|",
    ]
    for name, losses in curves.items():
        diff = max(abs(a - b) / b for a, b in zip(losses[-tail:], plain[-tail:], strict=True))
        cells = " | ".join(f"{losses[m - 1]:.4f}" for m in marks)
        lines.append(f"| {name} | {cells} | {100 * diff:.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1m", choices=list(gpt.SIZES))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--tail", type=int, default=20, help="steps the difference is taken over")
    parser.add_argument("--out", default="benchmarks/out/zeropp_curves.json")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(args.world_size, init_file, args, args.out), nprocs=args.world_size)
    with open(args.out) as f:
        curves = json.load(f)["curves"]
    print(table(curves, args.tail))


if __name__ == "__main__":
    main()
