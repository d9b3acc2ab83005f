"""A list unit casts each member's inputs, as FSDP2 does (``fully_shard([a, b], mp_policy=...)``).

Found by torch's test_fully_shard_training (test_grouped_module_cast_forward_inputs) run
with shardwrap installed (benchmarks/torch_suite): the engine hooks a unit's input cast on
the unit's module, which for a list is a container outside the tree that never runs, so
``b`` got the fp32 tensor ``a``'s output was turned into and failed against its bf16
weight. Compared with torch's FSDP2 on one gloo rank: output, its dtype and the gradients
bit for bit. Control (run once, ``_cast_member_inputs`` made a no-op): the door's forward
fails, "expected m1 and m2 to have the same dtype".
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import fsdp as torch_fsdp

import shardwrap


class FloatBetween(nn.Module):
    """``b`` sees an fp32 intermediate: only ``b``'s own input cast makes it bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).float())


def _run(fully_shard) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = FloatBetween()
    policy = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard([model.a, model.b], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    out = model(torch.randn(2, 8, generator=torch.Generator().manual_seed(1)))
    out.float().square().sum().backward()
    return out.detach(), [p.grad.full_tensor() for p in model.parameters()]


def test_a_list_unit_casts_each_members_inputs_as_fsdp2(one_rank):
    ref_out, ref_grads = _run(torch_fsdp.fully_shard)
    out, grads = _run(shardwrap.fully_shard)
    assert out.dtype == ref_out.dtype == torch.bfloat16
    assert torch.equal(out, ref_out)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
