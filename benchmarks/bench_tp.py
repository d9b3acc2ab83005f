"""ZeRO-3 over 4 data-parallel ranks against ZeRO-3 inside TP2 x DP2, on CPU gloo ranks.

Both layouts train the same GPT (separate q/k/v projections so that ``ColwiseParallel``
splits heads) on the same global batch; each prints its median step time, its per-rank
model state (parameter shards, gradients and AdamW state, measured from the optimizer's
tensors) and the bytes shardwrap's ledger records per step (data-parallel collectives:
TP's activation all-reduces are torch's and not on the ledger)::

    PYTHONPATH=$PWD python benchmarks/bench_tp.py --steps 20
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
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardwrap  # noqa: E402
from shardwrap.wrap import ModuleWrapPolicy  # noqa: E402

WORLD = 4
LAYOUTS = ("dp4", "tp2xdp2")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = (z(h) for z in (self.q, self.k, self.v))
        b, t = q.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, depth: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(layout: str, args: argparse.Namespace):
    """The wrapped model and this rank's data-parallel (index, size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.heads, args.depth)
    policy = ModuleWrapPolicy({Block})
    if layout == "dp4":
        return shardwrap.ShardedModule(model, auto_wrap_policy=policy), dist.get_rank(), WORLD
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {}
    for i in range(args.depth):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("proj", "out")})
    parallelize_module(model, mesh["tp"], plan)
    wrapped = shardwrap.ShardedModule(model, device_mesh=mesh["dp"], auto_wrap_policy=policy)
    return wrapped, mesh["dp"].get_local_rank(), 2


def state_bytes(optim: torch.optim.Optimizer) -> int:
    total = 0
    for group in optim.param_groups:
        for p in group["params"]:
            for t in (p, p.grad, *optim.state[p].values()):
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    total += t.numel() * t.element_size()
    return total


def run_layout(layout: str, args: argparse.Namespace) -> dict:
    model, dp_rank, dp = build(layout, args)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    global_batch = args.micro_batch * WORLD
    times, measured = [], 0
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (global_batch, args.seq + 1), generator=gen)
        rows = tokens[dp_rank * global_batch // dp : (dp_rank + 1) * global_batch // dp]
        model.comm_ledger.reset()
        dist.barrier()
        start = time.perf_counter()
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), rows[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        measured = state_bytes(optim)
        optim.zero_grad()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    ledger = sum(r.num_bytes for r in model.comm_ledger.records)
    return {"step_s": statistics.median(times), "state": measured, "ledger": ledger}


def worker(rank: int, init_file: str, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results = {layout: run_layout(layout, args) for layout in LAYOUTS}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2, help="per rank of the DP4 run")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "rdv"), args, queue), nprocs=WORLD)
    results = queue.get()
    params = sum(p.numel() for p in GPT(args.vocab, args.dim, args.heads, args.depth).parameters())
    print(f"GPT {params / 1e6:.2f}M parameters, global batch {args.micro_batch * WORLD}")
    print("| layout | step (ms, median) | model state / rank (MiB) | ledger bytes / step (MiB) |")
    print("|---|---|---|---|")
    for layout, r in results.items():
        print(
            f"| {layout} | {r['step_s'] * 1e3:.1f} | {r['state'] / 2**20:.2f} "
            f"| {r['ledger'] / 2**20:.2f} |"
        )


if __name__ == "__main__":
    main()
