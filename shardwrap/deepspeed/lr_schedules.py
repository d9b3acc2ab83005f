"""DeepSpeed's warm-up learning-rate schedules as ordinary torch LR schedulers.

[Note: which step sees which rate]
Each scheduler maps ``t``, the number of optimizer steps already taken, to a rate: the
first optimizer step runs with the rate for ``t = 0``, and ``scheduler.step()`` after an
optimizer step moves to ``t + 1`` (torch's convention; state_dict/load_state_dict and
``get_last_lr`` work as for any torch scheduler). The formulas are DeepSpeed's documented
ones. DeepSpeed's own schedulers start one step earlier (at ``t = -1``, where they leave
the rate at 0 for the first step), so their curve is ours shifted right by one step.

Warm-up ("log" or "linear"), with ``W = max(2, warmup_num_steps)``::

    log:    gamma(t) = ln(t + 1) / ln(W)        for t < W
    linear: gamma(t) = t / W                    for t < W
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..base.validate import check_int

WARMUP_TYPES = ("log", "linear")


def warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done after ``step`` optimizer steps (1.0 once past it)."""
    if step >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


def _per_group(optimizer: torch.optim.Optimizer, value: float | list, name: str) -> list[float]:
    num_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"{name}: got {len(value)} values for an optimizer with {num_groups} param groups"
            )
        return [float(v) for v in value]
    return [float(value)] * num_groups


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> int:
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type: expected one of {list(WARMUP_TYPES)}, got {warmup_type!r}")
    check_int("warmup_num_steps", warmup_num_steps, minimum=0)
    return max(2, warmup_num_steps)  # ln(1) = 0 would divide by zero


class WarmupLR(LRScheduler):
    """``lr(t) = min_lr + (max_lr - min_lr) * gamma(t)``; constant ``max_lr`` after warm-up."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_min_lr: float | list = 0.0,
        warmup_max_lr: float | list = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ) -> None:
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer)

    def gamma(self, step: int) -> float:
        return warmup_gamma(step, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float]:
        gamma = self.gamma(self.last_epoch)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """Warm up as :class:`WarmupLR`, then decay linearly to 0 at ``total_num_steps``::

    gamma(t) = max(0, (total_num_steps - t) / max(1, total_num_steps - W))   for t >= W
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_num_steps: int,
        warmup_min_lr: float | list = 0.0,
        warmup_max_lr: float | list = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ) -> None:
        self.total_num_steps = _check_total(total_num_steps)
        super().__init__(
            optimizer,
            warmup_min_lr=warmup_min_lr,
            warmup_max_lr=warmup_max_lr,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,
        )

    def gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
        remaining = self.total_num_steps - step
        return max(0.0, remaining / max(1, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(LRScheduler):
    """Scale each group's own ``lr`` by a ratio: warm up, then a cosine down to ``cos_min_ratio``.

    ``ratio(t) = warmup_min_ratio + (1 - warmup_min_ratio) * gamma(t)`` for ``t < W``; after::

        S = max(1, total_num_steps - W),  s = min(t - W + 1, S)
        ratio(t) = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * s / S)) / 2)

    ``s`` stops at ``S``, so the ratio stays at ``cos_min_ratio`` once the schedule ends
    (DeepSpeed's cosine would rise again past ``total_num_steps``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
    ) -> None:
        self.total_num_steps = _check_total(total_num_steps)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        super().__init__(optimizer)

    def ratio(self, step: int) -> float:
        if step < self.warmup_num_steps:
            gamma = warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        into_decay = min(step - self.warmup_num_steps + 1, decay_steps)
        cosine = (1.0 + math.cos(math.pi * into_decay / decay_steps)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.ratio(self.last_epoch)
        return [base_lr * ratio for base_lr in self.base_lrs]


def _check_total(total_num_steps: int) -> int:
    return check_int("total_num_steps", total_num_steps, minimum=1)
