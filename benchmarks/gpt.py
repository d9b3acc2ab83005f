"""The benchmark's GPT: every parameter trainable and used, no tied weights.

Untied and without a key bias on purpose: a tie puts one parameter in two units, and a
key bias gets a gradient that is zero up to rounding, which Adam turns into visible noise;
either would blur the loss comparison between implementations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape of one benchmark model."""

    vocab: int
    dim: int
    depth: int
    num_heads: int
    seq: int

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim={self.dim} must be a multiple of num_heads={self.num_heads}")


SIZES: dict[str, GPTConfig] = {
    "1m": GPTConfig(vocab=256, dim=128, depth=4, num_heads=4, seq=64),  # smoke runs only
    "5m": GPTConfig(vocab=512, dim=256, depth=6, num_heads=4, seq=64),
    "30m": GPTConfig(vocab=1024, dim=512, depth=9, num_heads=8, seq=64),
}


class Block(nn.Module):
    """Pre-norm transformer block; the unit every implementation wraps."""

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
        shape = (b, t, self.num_heads, d // self.num_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(config.vocab, config.dim)
        self.pos = nn.Embedding(config.seq, config.dim)
        self.blocks = nn.ModuleList(
            Block(config.dim, config.num_heads) for _ in range(config.depth)
        )
        self.ln_f = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


MODEL_SEED = 1234


def build(config: GPTConfig) -> GPT:
    """The same initial weights on every rank and for every implementation."""
    torch.manual_seed(MODEL_SEED)
    return GPT(config)


def num_params(config: GPTConfig) -> int:
    return sum(p.numel() for p in build(config).parameters())


def batch(config: GPTConfig, *, step: int, rank: int, batch_size: int):
    """Rank ``rank``'s micro-batch of step ``step`` (inputs, targets)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    idx = torch.randint(0, config.vocab, (batch_size, config.seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
