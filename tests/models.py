"""Small models shared by the tests: a GPT-like transformer and an MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The benchmark's block (re-exported): tests and benchmarks wrap the same unit.
from benchmarks.gpt import Block as Block


class TinyGPT(nn.Module):
    """GPT with a tied embedding/head, a frozen positional table and an optional branch.

    ``extra`` is only used when ``forward(..., use_extra=True)``: a parameter that gets no
    gradient in the steps that skip it.
    """

    def __init__(self, vocab: int = 64, dim: int = 32, depth: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02, requires_grad=False)
        self.blocks = nn.ModuleList(Block(dim, 4) for _ in range(depth))
        self.extra = nn.Linear(dim, dim)
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("scale", torch.ones(()))

    def forward(self, idx: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        if use_extra:
            x = x + self.extra(x)
        return self.head(self.ln_f(x)) * self.scale


class MLP(nn.Module):
    def __init__(self, dim: int = 12, hidden: int = 30, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(dim if i == 0 else hidden, hidden))
            layers.append(nn.Tanh())
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def gpt_batch(seed: int, batch: int = 2, seq: int = 16, vocab: int = 64):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def gpt_loss(model: nn.Module, batch, use_extra: bool = False) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs, use_extra=use_extra)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mlp_batch(seed: int, batch: int = 4, dim: int = 12):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, 1, generator=g)


def mlp_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)
