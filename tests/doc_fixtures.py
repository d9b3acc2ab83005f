"""Stand-ins for the user's own code in the guide's snippets (``MyTransformer``, ``loader``).

A snippet imports what it needs from here in a hidden ``<!-- snippet-setup: ... -->``
comment (see tests/dist/test_docs_snippets.py). Everything is tiny so that every snippet
of every page runs in seconds on 2 CPU ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

VOCAB, DIM, SEQ, NUM_CLASSES = 64, 32, 8, 4


class MyBlock(nn.Module):
    """A pre-norm residual MLP block (what a transformer layer looks like to a wrap policy)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.nn.functional.gelu(self.fc(self.norm(x))))


class MyTransformer(nn.Module):
    """Tokens ``(batch, SEQ)`` -> class logits ``(batch, NUM_CLASSES)``."""

    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MyBlock() for _ in range(depth))
        self.head = nn.Linear(DIM, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


class MyLM(nn.Module):
    """Tokens ``(batch, seq)`` -> next-token logits ``(batch, seq, VOCAB)``, with ``generate``.

    ``generate`` reads the root's own parameters (``self.tok``, ``self.head``) outside
    ``forward``, which is what ``register_forward_method`` is for.
    """

    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MyBlock() for _ in range(depth))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def generate(self, idx: torch.Tensor, steps: int) -> torch.Tensor:
        """Greedy decoding: append ``steps`` tokens to ``idx``."""
        for _ in range(steps):
            x = self.tok(idx)
            for block in self.blocks:
                x = block(x)
            logits = self.head(x[:, -1])
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
        return idx


def make_loader(
    num_batches: int = 2, batch_size: int = 4
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, targets)`` batches, different on every rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator().manual_seed(rank)
    return [
        (
            torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator),
            torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator),
        )
        for _ in range(num_batches)
    ]


def make_dataset(num_samples: int = 16) -> TensorDataset:
    """``(inputs, targets)`` samples, the same on every rank (a sampler splits them)."""
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randint(0, VOCAB, (num_samples, SEQ), generator=generator),
        torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator),
    )


def __getattr__(name: str):
    # ``from tests.doc_fixtures import loader``: built at import, after the process group
    # exists, so each rank gets its own batches.
    if name == "loader":
        return make_loader()
    if name == "dataset":
        return make_dataset()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
