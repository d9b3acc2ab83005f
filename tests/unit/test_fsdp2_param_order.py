"""The FSDP2 door's parameter order ([Note: FSDP2's parameter order] in layout/partition.py)
against torch's own: the managed modules and states its ``fully_shard`` lays a parameter
group out in (torch's ``_get_managed_modules`` / ``_get_managed_states``, no process group).

Negative control (in the test): ``named_parameters`` order differs for a model whose root
holds a parameter beside its children (seen: torch's FSDP2 gave the door's 3-rank test
other sums under AVX2 kernels while the door laid the root's own parameter first).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_init

from shardwrap.layout.partition import collect_params


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))  # own, beside a child
        self.proj = nn.Linear(3, 3)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(2))
        self.inner = Inner()
        self.head = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
        self.tied = self.inner.proj  # the same module twice: FSDP2 visits it once


def torch_order(model: nn.Module) -> list[int]:
    modules = _fsdp_init._get_managed_modules((model,))
    params, _ = _fsdp_init._get_managed_states(modules)
    return [id(p) for p in params]


def test_children_first_is_torchs_fsdp2_order():
    model = Outer()
    ours = [id(r.param) for r in collect_params(model, set(), set(), children_first=True)]
    assert ours == torch_order(model)
    pre_order = [id(r.param) for r in collect_params(model, set(), set())]
    assert pre_order != torch_order(model)  # the control: named_parameters order
