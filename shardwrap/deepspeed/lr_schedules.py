"""DeepSpeed's warm-up learning-rate schedules as ordinary torch LR schedulers.

[Note: which step sees which rate]
The rates follow DeepSpeed 0.19.8's classes step for step (tested against them). With
``i`` the number of ``scheduler.step()`` calls minus one (DeepSpeed's
``last_batch_iteration``; torch's ``last_epoch - 1``), the scheduler starts at ``i = -1``:
the first optimizer step runs with the "not started" rate (``warmup_min_lr`` for
``WarmupLR``/``WarmupDecayLR``, 0 for ``WarmupCosineLR``) and the second with the rate for
``i = 0`` (for ``WarmupLR`` the same ``warmup_min_lr`` again, since ``gamma(0) = 0``). The
engine calls ``scheduler.step()`` after each applied optimizer step, as DeepSpeed's does.
These are ordinary torch LR schedulers (state_dict/load_state_dict, ``get_last_lr``).

Warm-up ("log" or "linear"), with ``W = max(2, warmup_num_steps)``::

    log:    gamma(i) = ln(i + 1) / ln(W)        for 0 <= i < W
    linear: gamma(i) = i / W                    for 0 <= i < W
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..base.validate import check_int

WARMUP_TYPES = ("log", "linear")


def warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done at iteration ``step`` >= 0 (1.0 once past it)."""
    if step >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        # (1 / ln W) * ln(i + 1), in DeepSpeed's order of operations: equal to the last bit.
        return (1.0 / math.log(warmup_num_steps)) * math.log(step + 1)
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
    check_int("warmup_num_steps", warmup_num_steps, minimum=1)  # DeepSpeed's check too
    return max(2, warmup_num_steps)  # ln(1) = 0 would divide by zero


class WarmupLR(LRScheduler):
    """``lr(i) = min_lr + (max_lr - min_lr) * gamma(i)``; constant ``max_lr`` after warm-up.

    ``warmup_max_lr`` defaults to each group's own ``lr`` (DeepSpeed's default).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_min_lr: float | list = 0.0,
        warmup_max_lr: float | list | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ) -> None:
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer)

    def gamma(self, step: int) -> float:
        return warmup_gamma(step, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float]:
        iteration = self.last_epoch - 1  # [Note: which step sees which rate]
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self.gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """Warm up as :class:`WarmupLR`, then decay linearly to 0 at ``total_num_steps``::

    gamma(i) = max(0, (total_num_steps - i) / max(1, total_num_steps - W))   for i >= W
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

    ``ratio(-1) = 0`` (the first optimizer step runs at rate 0, as DeepSpeed's);
    ``ratio(i) = warmup_min_ratio + (1 - warmup_min_ratio) * gamma(i)`` for ``0 <= i < W``;
    after::

        S = max(1, total_num_steps - W),  s = min(i - W + 1, S)
        ratio(i) = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * s / S)) / 2)

    ``s`` stops at ``S``, so the ratio stays at ``cos_min_ratio`` once the schedule ends
    (as DeepSpeed 0.19.8's, which clamps its progress the same way).
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
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            gamma = warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.ratio(self.last_epoch - 1)  # [Note: which step sees which rate]
        return [base_lr * ratio for base_lr in self.base_lrs]


def _check_total(total_num_steps: int) -> int:
    return check_int("total_num_steps", total_num_steps, minimum=1)
