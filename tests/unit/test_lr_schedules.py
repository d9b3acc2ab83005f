"""DeepSpeed's warm-up schedules, checked against values worked out by hand.

As DeepSpeed's classes, a schedule starts one iteration before 0: the first optimizer step
runs with the "not started" rate (``test_lr_schedules_deepspeed.py`` compares with them).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwrap.deepspeed.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
from tests import tolerances

# The schedules and the hand formulas below evaluate the same real numbers in float64, each
# in at most 12 operations (min + (max - min) * gamma, a log, a cosine, a ratio...).
FORMULA = {"rel": tolerances.float64_formula_rtol(12), "abs": 0.0}


def optimizer(lr: float = 1.0, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=lr)


def rates(scheduler, optim, num_steps: int) -> list[float]:
    """The rate each optimizer step runs with (step k sees the schedule at k - 1)."""
    seen = []
    for _ in range(num_steps):
        seen.append(optim.param_groups[0]["lr"])
        optim.step()
        scheduler.step()
    return seen


def test_warmup_lr_log_and_linear():
    optim = optimizer()
    log = WarmupLR(optim, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10)
    expected = [0.0] + [math.log(t + 1) / math.log(10) for t in range(10)] + [1.0]
    assert rates(log, optim, 12) == pytest.approx(expected, **FORMULA)
    assert expected[2] == pytest.approx(0.30103, abs=5e-6)  # log10(2) to 5 decimals
    optim = optimizer()
    linear = WarmupLR(
        optim, warmup_min_lr=0.1, warmup_max_lr=0.5, warmup_num_steps=4, warmup_type="linear"
    )
    assert rates(linear, optim, 6) == pytest.approx([0.1, 0.1, 0.2, 0.3, 0.4, 0.5], **FORMULA)


def test_warmup_decay_lr():
    optim = optimizer()
    scheduler = WarmupDecayLR(
        optim, total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear"
    )
    # not started (0), warm-up 0, .25, .5, .75; then (10 - i) / 6 from i = 4; never below 0.
    expected = [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 5 / 6, 4 / 6, 0.5, 2 / 6, 1 / 6, 0.0]
    assert rates(scheduler, optim, 12) == pytest.approx(expected, **FORMULA)


def test_warmup_cosine_lr_scales_each_groups_own_rate():
    optim = optimizer(lr=2.0)
    scheduler = WarmupCosineLR(
        optim,
        total_num_steps=10,
        warmup_num_steps=2,
        warmup_type="linear",
        warmup_min_ratio=0.0,
        cos_min_ratio=0.1,
    )
    got = rates(scheduler, optim, 12)
    assert got[:3] == pytest.approx([0.0, 0.0, 1.0], **FORMULA)  # not started, 0, 0.5 of 2.0
    cosine = [0.1 + 0.9 * (1 + math.cos(math.pi * s / 8)) / 2 for s in range(1, 9)]
    assert got[3:11] == pytest.approx([2.0 * r for r in cosine], **FORMULA)
    assert got[10:] == pytest.approx([0.2, 0.2], **FORMULA)  # cos_min_ratio after the end


def test_per_group_values_and_state_round_trip():
    optim = optimizer(groups=2)
    scheduler = WarmupLR(optim, warmup_max_lr=[1.0, 2.0], warmup_num_steps=5, warmup_type="linear")
    for _ in range(3):
        optim.step()
        scheduler.step()
    assert [g["lr"] for g in optim.param_groups] == pytest.approx([0.4, 0.8], **FORMULA)
    state = scheduler.state_dict()
    fresh_optim = optimizer(groups=2)
    fresh = WarmupLR(
        fresh_optim, warmup_max_lr=[1.0, 2.0], warmup_num_steps=5, warmup_type="linear"
    )
    fresh.load_state_dict(state)
    fresh_optim.step()
    fresh.step()
    scheduler.step()
    assert fresh.get_last_lr() == scheduler.get_last_lr()  # the same state: the same rates
    with pytest.raises(ValueError, match="warmup_max_lr: got 3 values"):
        WarmupLR(optimizer(groups=2), warmup_max_lr=[1.0, 2.0, 3.0])
