"""Our warm-up schedules against DeepSpeed's own classes, rate by rate, for 30 steps."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime import lr_schedules as deepspeed_schedules

from shardwrap.deepspeed import lr_schedules

STEPS = 30


def _optimizer(lrs: list[float]) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def _rates(name: str, params: dict, lrs: list[float], ours: bool) -> list[list[float]]:
    """The rates of every group for each of STEPS optimizer steps, and get_lr() after each."""
    optimizer = _optimizer(lrs)
    module = lr_schedules if ours else deepspeed_schedules
    scheduler = getattr(module, name)(optimizer, **params)
    seen = []
    for _ in range(STEPS):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
        seen.append(list(scheduler.get_last_lr()))
    return seen


WARMUPS = [
    {"warmup_num_steps": steps, "warmup_type": kind}
    for steps in (1, 2, 10)
    for kind in ("log", "linear")
]


@pytest.mark.parametrize("warmup", WARMUPS, ids=str)
@pytest.mark.parametrize(
    ("name", "extra", "lrs"),
    [
        ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1}, [0.5]),
        ("WarmupLR", {"warmup_min_lr": [0.0, 0.02], "warmup_max_lr": [0.1, 0.3]}, [0.5, 0.5]),
        ("WarmupLR", {}, [0.2, 0.4]),  # warmup_max_lr defaults to each group's lr
        ("WarmupDecayLR", {"total_num_steps": 20, "warmup_max_lr": 0.1}, [0.5]),
        ("WarmupDecayLR", {"total_num_steps": 25, "warmup_min_lr": [0.0, 0.01]}, [0.5, 0.5]),
        ("WarmupCosineLR", {"total_num_steps": 20, "warmup_min_ratio": 0.1}, [0.2, 0.4]),
        ("WarmupCosineLR", {"total_num_steps": 5, "cos_min_ratio": 0.2}, [0.3]),
    ],
)
def test_rates_equal_deepspeeds_step_for_step(name, extra, lrs, warmup):
    params = {**extra, **warmup}
    assert _rates(name, params, lrs, ours=True) == _rates(name, params, lrs, ours=False)


def test_first_two_warmup_lr_steps_run_at_the_minimum():
    got = _rates("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1}, [0.5], ours=True)
    assert got[0] == [0.01] and got[2] == [0.01] and got[4] > [0.01]
