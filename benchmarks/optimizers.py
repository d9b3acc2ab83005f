"""Every implementation torch offers for its common optimizers, built as users build them.

Each entry takes a model and returns its optimizer, from ``model.parameters()`` (or from
``named_parameters()`` for per-parameter groups), with nothing cast or rewritten: the
parity matrix (tests/dist/test_parity_matrix.py) and ``bench_parity.py`` train every
strategy with each of them against DDP. ``foreach``/``fused`` are always explicit, so the
entry means the same kernel path on CPU and on CUDA (where torch's default differs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]

# The three kernel paths torch has for most optimizers: a Python loop over parameters,
# multi-tensor (foreach) ops, and one fused kernel (which bumps no version counter).
IMPLEMENTATIONS = {
    "loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def _decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The usual split: no weight decay on biases and norm weights.

    By name, not by ``ndim``: a sharded model's parameters are 1-D pieces.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("bias") or ".ln" in f".{name}" else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _entries() -> dict[str, OptimizerFactory]:
    table: dict[str, OptimizerFactory] = {}

    def add(name: str, cls: type, implementations: tuple[str, ...], **settings) -> None:
        for impl in implementations:
            kwargs = {**settings, **IMPLEMENTATIONS[impl]}
            table[f"{name}_{impl}"] = lambda m, c=cls, k=kwargs: c(m.parameters(), **k)

    every = ("loop", "foreach", "fused")
    add("adamw", torch.optim.AdamW, every, lr=1e-3, weight_decay=0.1)
    add("adamw_nowd", torch.optim.AdamW, every, lr=1e-3, weight_decay=0.0)
    add("adam", torch.optim.Adam, every, lr=1e-3)
    add("adam_l2", torch.optim.Adam, every, lr=1e-3, weight_decay=0.01)
    add("sgd_momentum", torch.optim.SGD, every, lr=0.05, momentum=0.9)
    add(
        "sgd_nesterov",
        torch.optim.SGD,
        every,
        lr=0.05,
        momentum=0.9,
        nesterov=True,
        weight_decay=0.01,
    )
    add("adagrad", torch.optim.Adagrad, every, lr=0.05, weight_decay=0.01)
    add("rmsprop", torch.optim.RMSprop, ("loop", "foreach"), lr=1e-3, momentum=0.9)
    add("rmsprop_wd", torch.optim.RMSprop, ("loop", "foreach"), lr=1e-3, weight_decay=0.01)
    for impl in every:
        kwargs = IMPLEMENTATIONS[impl]
        table[f"adamw_groups_{impl}"] = lambda m, k=kwargs: torch.optim.AdamW(
            _decay_groups(m, 0.1), lr=1e-3, **k
        )
    table["sgd_groups_foreach"] = lambda m: torch.optim.SGD(
        _decay_groups(m, 0.01), lr=0.05, momentum=0.9, foreach=True
    )
    return table


OPTIMIZERS: dict[str, OptimizerFactory] = _entries()
