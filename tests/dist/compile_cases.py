"""Rank workers for tests/dist/test_compile.py: compiled blocks inside sharded units.

The reference is torch's own FSDP2 (``fully_shard`` per block, then the root) running the
same compiled blocks. Both implementations hand the compiled block the same plain tensors
(the gathered parameters) and at two ranks every gradient sum has two terms, which floating
point adds the same way in any order: so the two must agree bit for bit, on any CPU, while
the compiled kernels themselves (inductor's, which fuse and reorder) may differ from eager.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardwrap
from shardwrap.policies import ModuleWrapPolicy
from tests import models
from tests.dist.parity import check_shards

NUM_STEPS = 4
# From this step on a recompile is an error: step 0 compiles forward and backward, step 1
# may specialise once more (torch marks sizes dynamic after a change), then nothing.
NO_RECOMPILE_FROM_STEP = 2
LR = 0.05


@dataclass
class Run:
    """What one training run left: its losses and the compiler's counts during it."""

    losses: list[float] = field(default_factory=list)
    graph_breaks: int = 0
    frames_compiled: int = 0


def build_model(compile_blocks: bool) -> nn.Module:
    torch.manual_seed(1234)
    model = models.TinyGPT(depth=2)
    if compile_blocks:
        for block in model.blocks:
            block.compile(fullgraph=True)
    return model


def _train(model: nn.Module, rank: int) -> Run:
    optim = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    run = Run()
    breaks_before = sum(counters["graph_break"].values())
    frames_before = counters["frames"]["ok"]
    for step in range(NUM_STEPS):
        with torch._dynamo.config.patch(error_on_recompile=step >= NO_RECOMPILE_FROM_STEP):
            loss = models.gpt_loss(model, models.gpt_batch(100 * step + rank))
            loss.backward()
        optim.step()
        optim.zero_grad()
        run.losses.append(float(loss.detach()))
    run.graph_breaks = sum(counters["graph_break"].values()) - breaks_before
    run.frames_compiled = counters["frames"]["ok"] - frames_before
    return run


def torch_fsdp2(compile_blocks: bool) -> tuple[Run, nn.Module]:
    """Torch FSDP2 on the test model; the run and an unwrapped copy of its final parameters."""
    model = build_model(compile_blocks)
    plain = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run = _train(model, dist.get_rank())
    full = {name: _full(value) for name, value in model.state_dict().items()}
    plain.load_state_dict(full)
    return run, plain


def _full(value: torch.Tensor) -> torch.Tensor:
    # parameters are DTensors; buffers stay plain tensors
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def shardwrap_run(strategy: str, compile_blocks: bool, *, after_wrap: bool = False):
    """shardwrap on the test model; the run and the wrapped model."""
    model = build_model(compile_blocks and not after_wrap)
    sharded = shardwrap.ShardedModule(
        model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({models.Block})
    )
    if after_wrap:
        for block in model.blocks:
            block.compile(fullgraph=True)
    return _train(sharded, dist.get_rank()), sharded


def whole_model_run() -> tuple[Run, shardwrap.ShardedModule]:
    """``torch.compile`` on the wrapped model (eager blocks): graphs break at unit hooks."""
    sharded = shardwrap.ShardedModule(
        build_model(False), auto_wrap_policy=ModuleWrapPolicy({models.Block})
    )
    return _train(torch.compile(sharded), dist.get_rank()), sharded


def max_difference(sharded: shardwrap.ShardedModule, reference: nn.Module) -> float:
    """The largest elementwise difference between the shards and the reference's slices."""
    worst = 0.0
    ref = dict(reference.named_parameters())
    for unit in sharded.units:
        handle = unit.handle
        if handle is None:
            continue
        pieces = handle.layout.pieces(handle.shard_comm.rank)
        for info, piece, shard in zip(handle.layout.params, pieces, handle.shard_params):
            full = ref[info.fqn].detach().reshape(-1)
            expected = full if handle.num_shards == 1 else full[piece.param_start : piece.param_end]
            diff = (shard.detach().reshape(-1) - expected).abs()
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return worst


__all__ = [
    "Run",
    "check_shards",
    "max_difference",
    "shardwrap_run",
    "torch_fsdp2",
    "whole_model_run",
]
