"""The FSDP2 door's optimizer steps on local shards ([Note: stepping the local shards] in
shardwrap/fsdp2/local_step.py).

That the numbers are FSDP2's is the door's comparisons' to show: every AdamW script of
tests/dist/test_fsdp2_door.py and the client tests steps locally from its second step
and equals torch's FSDP2 bit for bit (negative control, run once: the local step handed
doubled gradients fails test_fsdp2_door's adamw case, every parameter apart after step 1). Here:
that the local path is taken (no DTensor dispatch in the step) where it may be, not
where it may not (a subclass, the first step), and that the optimizer is FSDP2's between
steps, a step that raised included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist import fsdp2_cases as fc
from tests.dist.harness import run_ranks


class SubclassedAdamW(torch.optim.AdamW):
    """Not stepped locally: a subclass's step may not be elementwise."""


class _DTensorOps(TorchDispatchMode):
    """Counts the ops dispatched with a DTensor among their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _dispatches(step) -> int:
    """DTensor ops while ``step()`` runs."""
    with _DTensorOps() as ops:
        step()
    return ops.count


def _train(model, optimizer, steps: int, rank: int) -> list[int]:
    counts = []
    for step in range(steps):
        idx, target = fc.batch(step, rank)
        F.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1)).backward()
        counts.append(_dispatches(optimizer.step))
        optimizer.zero_grad()
    return counts


def _between_steps_is_fsdp2s(model, optimizer) -> bool:
    params = list(model.parameters())
    held = [p for group in optimizer.param_groups for p in group["params"]]
    states = [optimizer.state[p] for p in params if p in optimizer.state]
    return (
        all(a is b for a, b in zip(held, params, strict=True))
        and len(optimizer.state) == len(params)
        and all(
            isinstance(v, DTensor) and v.placements == p.placements
            for p, state in zip(params, states, strict=True)
            for k, v in state.items()
            if k != "step"
        )
    )


def local_steps(rank: int, world_size: int) -> dict:
    found = {}
    for name, kind in (("adamw", torch.optim.AdamW), ("subclass", SubclassedAdamW)):
        model = fc.sharded_tiny_model(world_size)
        optimizer = kind(model.parameters(), lr=fc.LR)
        found[name] = _train(model, optimizer, 3, rank)
        found[f"{name}_between"] = _between_steps_is_fsdp2s(model, optimizer)
    # A step that raises with the views in place (a pre-hook registered after the first
    # step runs after the swap): the next state_dict() and step put them back.
    model = fc.sharded_tiny_model(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=fc.LR)
    _train(model, optimizer, 1, rank)

    def fail(*_):
        raise RuntimeError("injected")

    handle = optimizer.register_step_pre_hook(fail)
    idx, target = fc.batch(1, rank)
    F.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1)).backward()
    try:
        optimizer.step()
    except RuntimeError:
        pass
    handle.remove()
    saved = optimizer.state_dict()
    found["after_raise"] = _between_steps_is_fsdp2s(model, optimizer) and len(saved["state"])
    found["after_raise_steps"] = _train(model, optimizer, 2, rank)
    return found


def test_adam_steps_the_local_shards_and_is_fsdp2s_between_steps():
    """Negative control (run once): the views never entered gives AdamW's steps 2 and 3
    the subclass's dispatch counts."""
    for rank, found in enumerate(run_ranks(local_steps, 2)):
        first, *rest = found["adamw"]
        assert first > 0 and rest == [0, 0], (rank, found["adamw"])
        assert all(count > 0 for count in found["subclass"]), (rank, found["subclass"])
        assert found["adamw_between"] and found["subclass_between"], rank
        assert found["after_raise"], rank
        assert found["after_raise_steps"][-1] == 0, (rank, found["after_raise_steps"])
