"""bf16 under TP2 x DP2 against single-process fp32 training: the parameters' updates.

Plain SGD, so an update is ``lr`` times the sum of the gradients and a gradient that is
scaled, zeroed or lost shows in the parameters (Adam's step hides a scale). The workers
take a fault for the negative controls of tests/dist/test_tensor_parallel.py.
"""

from __future__ import annotations

import torch

import shardwrap
from tests.dist import tp_cases

SGD_LR = 0.5
NUM_STEPS = 3
FAULTS = ("zero_grads",)  # what the negative control does to the gradients


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.state_dict().items()}


def reference() -> tuple[dict, dict]:
    """Initial and final parameters of fp32 SGD on the global batch, in one process."""
    model = tp_cases.build_reference()
    initial = _params(model)
    optim = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    for step in range(NUM_STEPS):
        tp_cases.loss_of(model, *tp_cases.global_batch(step)).backward()
        optim.step()
        optim.zero_grad()
    return initial, _params(model)


def bf16_run(rank: int, world_size: int, faults: tuple[str, ...]) -> dict[str, dict]:
    """Final parameters of bf16 SGD training as it is (key None) and with each fault."""
    return {fault: _train(fault) for fault in (None, *faults)}


def _train(fault: str | None) -> dict[str, torch.Tensor]:
    mesh = tp_cases.make_mesh()
    policy = shardwrap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = tp_cases.build_reference()
    model = tp_cases.wrap(tp_cases.parallelized(model, mesh), mesh, mixed_precision=policy)
    optim = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(NUM_STEPS):
        batch = tp_cases.local_rows(tp_cases.global_batch(step), dp_rank)
        tp_cases.loss_of(model, *batch).float().backward()
        for param in model.parameters():
            if fault == "zero_grads":
                param.grad.zero_()
            elif fault == "half_grads":
                param.grad.mul_(0.5)
        optim.step()
        optim.zero_grad()
    return _params(model)


def update_errors(initial: dict, expected: dict, got: dict) -> dict[str, float]:
    """Per parameter, how far ``got``'s update is from ``expected``'s, relative to the
    latter: ``|got - expected| / |expected - initial|`` (2-norms)."""
    return {
        name: float((got[name] - want).norm() / (want - initial[name]).norm())
        for name, want in expected.items()
    }
