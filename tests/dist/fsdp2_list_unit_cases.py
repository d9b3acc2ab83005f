"""A list unit (``fully_shard([norm, head])``) whose modules do not each run once per root
forward, on torch's FSDP2 and on shardwrap's door (worker side, test_fsdp2_door.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh

import shardwrap
from tests.dist.fsdp2_cases import _plain

STEPS = 3


class HeadLast(nn.Module):
    """A model whose forward may stop before its head, which the loss then calls."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        hidden = self.norm(torch.tanh(self.body(self.embed(idx))))
        return hidden if skip_head else self.head(hidden)


def train(rank: int, world_size: int, side: str, mode: str) -> dict:
    """``mode``: "skip" (the head never runs: the loss is on the normed hidden state),
    "twice" (two such forwards, then one backward of both) or "chunks" (the head called
    per chunk of the batch, after the forward). The losses and
    full parameters, or the error."""
    shard = torch_fsdp.fully_shard if side == "torch" else shardwrap.fully_shard
    torch.manual_seed(0)
    model = HeadLast()
    mesh = init_device_mesh("cpu", (world_size,))
    shard(model.body, mesh=mesh)
    shard([model.norm, model.head], mesh=mesh)
    shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    try:
        for step in range(STEPS):
            idx = torch.randint(
                0, 16, (2, 5), generator=torch.Generator().manual_seed(10 * step + rank)
            )
            hidden = model(idx, skip_head=True)
            if mode == "skip":
                loss = hidden.square().mean()
            elif mode == "twice":  # a second forward before the backward of both
                loss = hidden.square().mean() + model(idx.flip(0), skip_head=True).abs().mean()
            else:
                loss = sum(model.head(c).square().mean() for c in hidden.chunk(2))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(float(loss.detach()))
    except NotImplementedError as error:  # the same call on every rank
        return {"error": str(error)}
    finally:
        dist.barrier()
    return {
        "losses": losses,
        "params": {n: _plain(p.detach()) for n, p in model.named_parameters()},
    }


def both(rank: int, world_size: int, mode: str) -> dict:
    return {side: train(rank, world_size, side, mode) for side in ("torch", "shardwrap")}
