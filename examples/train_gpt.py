"""Train a small character-level GPT with shardwrap (ZeRO-3) under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py

On CPU the ranks use gloo; with CUDA, NCCL and one GPU per rank. The corpus is the
project's README, so nothing is downloaded. It starts from the newest checkpoint in
``--ckpt-dir`` that loads, when there is one (a restarted job goes on where it stopped).
Without ``--save-every``, halfway through it saves a sharded checkpoint, restores it into
a freshly built model (as a restarted job would) and trains on; with it, it saves every
that many steps, which is what a job restarted by torchrun's elastic agent resumes from:

    torchrun --nnodes 1:2 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint HOST:PORT examples/train_gpt.py --save-every 10

Each step's batch depends only on the step and the rank, so a resumed run sees the data
the uninterrupted one would have.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwrap
from shardwrap.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from shardwrap.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.num_heads, -1).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, depth: int, num_heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, num_heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        nn.init.normal_(self.tok.weight, std=0.02)  # small logits at the start

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def corpus() -> torch.Tensor:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def batch(data: torch.Tensor, seq: int, size: int, step: int, rank: int):
    """Step ``step``'s sequences for ``rank``: the same whoever asks, and whenever."""
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    starts = torch.randint(0, len(data) - seq - 1, (size,), generator=generator)
    rows = torch.stack([data[s : s + seq + 1] for s in starts])
    return rows[:, :-1], rows[:, 1:]


def human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:7.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:7.1f} TiB"


def report_memory(model: shardwrap.ShardedModule, optim: torch.optim.Optimizer, rank: int):
    """Bytes this rank holds of parameters, gradients and optimizer state vs. unsharded."""
    num_params = sum(i.numel for u in model.units if u.handle for i in u.handle.layout.params)
    shards = [p for u in model.units if u.handle for p in u.handle.shard_params]
    held = {
        "parameters": sum(p.numel() * p.element_size() for p in shards),
        "gradients": sum(
            p.grad.numel() * p.grad.element_size() for p in shards if p.grad is not None
        ),
        "optimizer": sum(
            t.numel() * t.element_size()
            for state in optim.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        ),
    }
    unsharded = {
        "parameters": 4 * num_params,
        "gradients": 4 * num_params,
        "optimizer": 8 * num_params,
    }
    lines = [
        f"rank {rank}: {name:10s} {human(held[name])} of {human(unsharded[name])} unsharded"
        for name in held
    ]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, "\n".join(lines))
    if rank == 0:
        print("\n".join(gathered))


def build(args, device: torch.device, use_cuda: bool, seed: int = 0):
    torch.manual_seed(seed)  # same initial weights on every rank
    model = GPT(vocab=256, dim=args.dim, depth=args.depth, num_heads=4, seq=args.seq)
    model = shardwrap.ShardedModule(
        model,
        sharding_strategy=args.strategy,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=device if use_cuda else None,
    )
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def train(model, optim, data, args, steps: range, device: torch.device) -> None:
    """Train over ``steps``; with ``--save-every``, save after every that many steps."""
    rank = dist.get_rank()
    start = time.perf_counter()
    for count, step in enumerate(steps, start=1):
        inputs, targets = (t.to(device) for t in batch(data, args.seq, args.batch, step, rank))
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        if step == args.steps:
            report_memory(model, optim, rank)
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / dist.get_world_size()
        if rank == 0 and args.losses:
            with open(args.losses, "a", encoding="utf-8") as log:
                log.write(f"{step} {mean.hex()}\n")
        if rank == 0 and (step % 5 == 0 or count == 1):
            elapsed = time.perf_counter() - start
            print(f"step {step:4d}/{args.steps}  loss {mean:.4f}  {elapsed / count:.3f}s/step")
        if args.save_every and step % args.save_every == 0:
            save_checkpoint(
                Path(args.ckpt_dir) / f"step-{step}", model, optim, extra={"step": step}
            )


def resume(ckpt_dir: str, model, optim) -> int:
    """Load the newest checkpoint under ``ckpt_dir`` that loads; its step (0: none).

    A refused load changes nothing, so one that a killed save left unfinished (or a
    damaged one) is skipped for the one before it.
    """
    folders = [p for p in Path(ckpt_dir).glob("step-*") if p.name[5:].isdigit()]
    for folder in sorted(folders, key=lambda p: int(p.name[5:]), reverse=True):
        try:
            extra = load_checkpoint(folder, model, optim)
        except CheckpointError as error:
            if dist.get_rank() == 0:
                print(f"skipping {folder}: {error}")
            continue
        if dist.get_rank() == 0:
            print(f"resumed from {folder}", flush=True)
        return int(extra["step"])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--strategy", default="FULL_SHARD")
    parser.add_argument("--ckpt-dir", default="runs/demo", help="where checkpoints go")
    parser.add_argument("--save-every", type=int, default=0, help="steps between saves")
    parser.add_argument("--losses", default="", help="rank 0 appends 'step loss.hex()' here")
    args = parser.parse_args()
    if args.save_every < 0:
        parser.error(f"--save-every: expected a step count >= 0, got {args.save_every}")

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by torchrun
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)

    if rank == 0:
        num_params = sum(
            p.numel() for p in GPT(256, args.dim, args.depth, 4, args.seq).parameters()
        )
        print(
            f"training a {num_params / 1e6:.2f}M-parameter GPT, {args.strategy}, "
            f"{dist.get_world_size()} ranks on {device.type}"
        )
    data = corpus().to(device)
    model, optim = build(args, device, use_cuda)
    done = resume(args.ckpt_dir, model, optim)
    if args.save_every or done:
        train(model, optim, data, args, range(done + 1, args.steps + 1), device)
    else:
        demo_restart(model, optim, data, args, device, use_cuda)
    if rank == 0:
        print(f"trained to step {args.steps}; checkpoints in {args.ckpt_dir}", flush=True)
    dist.destroy_process_group()


def demo_restart(model, optim, data, args, device: torch.device, use_cuda: bool) -> None:
    """The demo: train half, save, restore into a fresh model as a restarted job would,
    train the rest and save."""
    half = args.steps // 2
    train(model, optim, data, args, range(1, half + 1), device)
    ckpt = Path(args.ckpt_dir) / f"step-{half}"
    save_checkpoint(ckpt, model, optim, extra={"step": half})
    if dist.get_rank() == 0:
        print(f"saved a sharded checkpoint to {ckpt}; restoring it into a fresh model")
    del model, optim  # as if the job had been restarted
    model, optim = build(args, device, use_cuda, seed=1)  # other weights: the load must win
    extra = load_checkpoint(ckpt, model, optim)
    train(model, optim, data, args, range(extra["step"] + 1, args.steps + 1), device)
    final = Path(args.ckpt_dir) / f"step-{args.steps}"
    save_checkpoint(final, model, optim, extra={"step": args.steps})
    if dist.get_rank() == 0:
        print(f"saved {final}; look inside with: python -m shardwrap inspect {final}")


if __name__ == "__main__":
    main()
