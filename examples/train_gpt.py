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
the uninterrupted one would have. With ``--global-batch G`` the batches come instead from
a ``ResumableSampler`` over the corpus's windows (``G`` per step across all ranks, in an
order that does not depend on the world size), saved and restored with the checkpoints, so
a run resumed at another world size sees each sample of the epoch once. With
``--memory-dir`` it saves through ``CheckpointTiers``: a memory tier (a folder on fast
node-local storage such as ``/dev/shm``) every ``--memory-every`` steps and the disk tier
``--ckpt-dir`` every ``--save-every`` steps, and resumes from the newest good one of both.
``--collective-timeout S`` turns a hung rank into ``CollectiveTimeoutError`` after ``S`` s.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwrap
from shardwrap.checkpoint import (
    CheckpointError,
    CheckpointTiers,
    load_checkpoint,
    load_newest,
    save_checkpoint,
    save_tiered,
)
from shardwrap.data.sampler import ResumableSampler
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


class Batches:
    """Where each step's batch comes from: ``batch()`` by (step, rank), or, with
    ``--global-batch``, a ``ResumableSampler`` over the corpus's ``seq + 1``-long windows
    (its position travels in the checkpoints)."""

    def __init__(self, data: torch.Tensor, args, rank: int, world_size: int) -> None:
        self.data, self.args, self.rank = data, args, rank
        self.sampler: ResumableSampler | None = None
        self.windows: torch.Tensor | None = None  # (num_samples, seq + 1)
        self._order = None  # the sampler's iterator, made after any resume
        if args.global_batch:
            num = len(data) // (args.seq + 1)
            num = min(num, args.num_samples) if args.num_samples else num
            self.windows = data[: num * (args.seq + 1)].view(num, args.seq + 1)
            self.sampler = ResumableSampler(
                num, global_batch_size=args.global_batch, rank=rank, world_size=world_size
            )

    def next(self, step: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Inputs, targets and sample ids (empty without a sampler) of ``step``."""
        if self.sampler is None:
            inputs, targets = batch(self.data, self.args.seq, self.args.batch, step, self.rank)
            return inputs, targets, []
        if self._order is None:
            self._order = iter(self.sampler)
        ids = next(self._order)
        rows = self.windows[ids]
        return rows[:, :-1], rows[:, 1:], ids

    def restart(self) -> None:
        """Go on from the sampler's position as a checkpoint load just set it."""
        self._order = None


def record_samples(path: str, step: int, ids: list[int]) -> None:
    """Rank 0 appends ``step world_size unix_time pid id,id,...`` (every rank's ids, in rank
    order: the step's global batch; the pid tells a restarted worker's steps apart)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ids)
    if dist.get_rank() == 0:
        every = ",".join(str(i) for part in gathered for i in part)
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{step} {dist.get_world_size()} {time.time():.3f} {os.getpid()} {every}\n")


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


def train(model, optim, source: Batches, args, steps: range, device, tiers=None) -> None:
    """Train over ``steps``; with ``--save-every`` (or tiers), save after every that many."""
    rank = dist.get_rank()
    start = time.perf_counter()
    for count, step in enumerate(steps, start=1):
        inputs, targets, ids = source.next(step)
        inputs, targets = inputs.to(device), targets.to(device)
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
        if args.samples:
            record_samples(args.samples, step, ids)
        if rank == 0 and (step % 5 == 0 or count == 1):
            elapsed = time.perf_counter() - start
            print(f"step {step:4d}/{args.steps}  loss {mean:.4f}  {elapsed / count:.3f}s/step")
        if tiers is not None:
            save_tiered(tiers, step, model, optim, extra={"step": step}, sampler=source.sampler)
        elif args.save_every and step % args.save_every == 0:
            folder = Path(args.ckpt_dir) / f"step-{step}"
            save_checkpoint(folder, model, optim, extra={"step": step}, sampler=source.sampler)


def checkpoint_tiers(args) -> CheckpointTiers | None:
    """With ``--memory-dir``: the memory tier there, the disk tier in ``--ckpt-dir``.

    torchrun numbers a node's ranks consecutively and says how many there are
    (``LOCAL_WORLD_SIZE``), so that is a node's size (not host names: two agents on one
    machine are two nodes here). Peer copies need a second node.
    """
    if not args.memory_dir:
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return CheckpointTiers(
        memory=args.memory_dir,
        memory_every=args.memory_every,
        disk=args.ckpt_dir if args.save_every else None,
        disk_every=max(args.save_every, 1),
        keep=args.keep,
        peer_copy=dist.get_world_size() // per_node >= 2,
        ranks_per_node=per_node,
    )


def resume_tiered(tiers: CheckpointTiers, model, optim, sampler) -> int:
    """Load the newest good checkpoint of either tier; its step (0: none yet)."""
    try:
        resumed = load_newest(tiers, model, optim, sampler=sampler)
    except CheckpointError as error:
        if dist.get_rank() == 0:
            print(f"starting afresh: {error}", flush=True)
        return 0
    if dist.get_rank() == 0:
        print(f"resumed at world size {dist.get_world_size()}: {resumed.selection.describe()}")
    return int(resumed.extra["step"])


def resume(ckpt_dir: str, model, optim, sampler=None) -> int:
    """Load the newest checkpoint under ``ckpt_dir`` that loads; its step (0: none).

    A refused load changes nothing, so one that a killed save left unfinished (or a
    damaged one) is skipped for the one before it.
    """
    folders = [p for p in Path(ckpt_dir).glob("step-*") if p.name[5:].isdigit()]
    for folder in sorted(folders, key=lambda p: int(p.name[5:]), reverse=True):
        try:
            extra = load_checkpoint(folder, model, optim, sampler=sampler)
        except CheckpointError as error:
            if dist.get_rank() == 0:
                print(f"skipping {folder}: {error}")
            continue
        if dist.get_rank() == 0:
            print(f"resumed from {folder}", flush=True)
        return int(extra["step"])
    return 0


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--memory-dir", default="", help="memory tier folder (e.g. /dev/shm/x)")
    parser.add_argument("--memory-every", type=int, default=1, help="steps between memory saves")
    parser.add_argument("--keep", type=int, default=2, help="steps each tier keeps")
    parser.add_argument("--global-batch", type=int, default=0, help="ResumableSampler's batch")
    parser.add_argument("--num-samples", type=int, default=0, help="the epoch (0: all windows)")
    parser.add_argument("--samples", default="", help="rank 0 appends each step's sample ids")
    parser.add_argument("--collective-timeout", type=float, default=0, help="seconds; 0: off")
    parser.add_argument("--digest", default="", help="rank 0 writes the final weights' sha256")
    args = parser.parse_args()
    for name in ("save_every", "global_batch", "num_samples", "collective_timeout"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')}: expected >= 0, got {getattr(args, name)}")
    return args


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    timeout = {}
    # On NCCL (no monitored barrier) the process group's own timeout is the only bound on
    # a rank that does not arrive. On gloo the named checks below bound it, and a process
    # group timeout would also cut short slow work that is not a hang (a large save).
    if args.collective_timeout and use_cuda:
        timeout["timeout"] = datetime.timedelta(seconds=args.collective_timeout)
    dist.init_process_group("nccl" if use_cuda else "gloo", **timeout)
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
    source = Batches(corpus().to(device), args, rank, dist.get_world_size())
    model, optim = build(args, device, use_cuda)
    if args.collective_timeout:  # a rank that does not arrive: a named error, not a hang
        model.set_collective_checks(True, timeout_s=args.collective_timeout)
    tiers = checkpoint_tiers(args)
    if tiers is not None:
        done = resume_tiered(tiers, model, optim, source.sampler)
    else:
        done = resume(args.ckpt_dir, model, optim, source.sampler)
    if args.save_every or done or tiers is not None:
        train(model, optim, source, args, range(done + 1, args.steps + 1), device, tiers)
    else:
        demo_restart(model, optim, source, args, device, use_cuda)
    if args.digest:
        write_digest(model, args.digest)
    if rank == 0:
        print(f"trained to step {args.steps}; checkpoints in {args.ckpt_dir}", flush=True)
    dist.destroy_process_group()


def write_digest(model, path: str) -> None:
    """Rank 0 writes the sha256 of every full parameter's bytes, in name order."""
    digest = hashlib.sha256()
    with shardwrap.ShardedModule.summon_full_params(model, writeback=False):
        for name, param in sorted(model.named_parameters()):
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    if dist.get_rank() == 0:
        Path(path).write_text(digest.hexdigest() + "\n")


def demo_restart(model, optim, source, args, device: torch.device, use_cuda: bool) -> None:
    """The demo: train half, save, restore into a fresh model as a restarted job would,
    train the rest and save."""
    half = args.steps // 2
    train(model, optim, source, args, range(1, half + 1), device)
    ckpt = Path(args.ckpt_dir) / f"step-{half}"
    save_checkpoint(ckpt, model, optim, extra={"step": half}, sampler=source.sampler)
    if dist.get_rank() == 0:
        print(f"saved a sharded checkpoint to {ckpt}; restoring it into a fresh model")
    del model, optim  # as if the job had been restarted
    model, optim = build(args, device, use_cuda, seed=1)  # other weights: the load must win
    extra = load_checkpoint(ckpt, model, optim, sampler=source.sampler)
    source.restart()
    train(model, optim, source, args, range(extra["step"] + 1, args.steps + 1), device)
    final = Path(args.ckpt_dir) / f"step-{args.steps}"
    save_checkpoint(final, model, optim, extra={"step": args.steps})
    if dist.get_rank() == 0:
        print(f"saved {final}; look inside with: python -m shardwrap inspect {final}")


if __name__ == "__main__":
    main()
