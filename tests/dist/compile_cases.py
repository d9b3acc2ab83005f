"""Rank workers for tests/dist/test_compile.py: compiled blocks inside sharded units.

The reference is torch's own FSDP2 (``fully_shard`` per block, then the root) running the
same compiled blocks. Both implementations hand the compiled block the same plain tensors
(the gathered parameters) and at two ranks every gradient sum has two terms, which floating
point adds the same way in any order: so the two must agree bit for bit, on any CPU, while
the compiled kernels themselves (inductor's, which fuse and reorder) may differ from eager.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

import shardwrap
from benchmarks.comm_count import CollectiveCounter
from shardwrap.checkpoint import load_checkpoint, save_checkpoint
from shardwrap.options import MixedPrecision
from shardwrap.policies import ModuleWrapPolicy
from tests import models

NUM_STEPS = 4
# From this step on a recompile is an error: step 0 compiles forward and backward, step 1
# may specialise once more (torch marks sizes dynamic after a change), then nothing.
NO_RECOMPILE_FROM_STEP = 2
LR = 0.05
CLIP_NORM = 0.5  # well under the gradients' norm here, so clipping changes every step


@dataclass(frozen=True)
class Steps:
    """How a run steps: gradient accumulation without sync, and clipping before the step."""

    microbatches: int = 1
    no_sync: Callable[[nn.Module], AbstractContextManager] = contextlib.nullcontext
    clip: Callable[[nn.Module], object] | None = None


@dataclass
class Run:
    """What one training run left: its losses and the compiler's counts during it."""

    losses: list[float] = field(default_factory=list)
    graph_breaks: int = 0
    frames_compiled: int = 0
    optimizer: torch.optim.Optimizer | None = field(default=None, repr=False, compare=False)


class CheckpointedBlock(models.Block):
    """The test block with its body under non-reentrant activation checkpointing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


@dataclass(frozen=True)
class Variant:
    """What the model computes: checkpointed blocks, a compute dtype."""

    checkpointed: bool = False
    param_dtype: torch.dtype | None = None  # mixed precision; reductions stay in fp32


def build_model(compile_blocks: bool, variant: Variant = Variant()) -> nn.Module:
    torch.manual_seed(1234)
    model = models.TinyGPT(depth=2)
    for block in model.blocks:
        if variant.checkpointed:
            block.__class__ = CheckpointedBlock
        if compile_blocks:
            block.compile(fullgraph=True)
    return model


def _train(model: nn.Module, rank: int, steps: Steps | None = None) -> Run:
    steps = steps or Steps()
    optim = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    run = Run()
    breaks_before = sum(counters["graph_break"].values())
    frames_before = counters["frames"]["ok"]
    for step in range(NUM_STEPS):
        with torch._dynamo.config.patch(error_on_recompile=step >= NO_RECOMPILE_FROM_STEP):
            for micro in range(steps.microbatches):
                last = micro == steps.microbatches - 1
                with contextlib.nullcontext() if last else steps.no_sync(model):
                    batch = models.gpt_batch(100 * step + 10 * micro + rank)
                    loss = models.gpt_loss(model, batch)
                    loss.backward()
        if steps.clip is not None:
            steps.clip(model)
        optim.step()
        optim.zero_grad()
        run.losses.append(float(loss.detach()))
    run.optimizer = optim
    run.graph_breaks = sum(counters["graph_break"].values()) - breaks_before
    run.frames_compiled = counters["frames"]["ok"] - frames_before
    return run


def torch_fsdp2(
    compile_blocks: bool, variant: Variant = Variant(), steps: Steps | None = None
) -> tuple[Run, nn.Module]:
    """Torch FSDP2 on the test model; the run and an unwrapped copy of its final parameters."""
    model = build_model(compile_blocks, variant)
    plain = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=variant.param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    run = _train(model, dist.get_rank(), steps)
    full = {name: _full(value) for name, value in model.state_dict().items()}
    plain.load_state_dict(full)
    return run, plain


@contextlib.contextmanager
def fsdp2_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _full(value: torch.Tensor) -> torch.Tensor:
    # parameters are DTensors; buffers stay plain tensors
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def shardwrap_model(
    strategy: str, compile_blocks: bool, variant: Variant = Variant(), **kwargs
) -> shardwrap.ShardedModule:
    precision = None
    if variant.param_dtype is not None:
        precision = MixedPrecision(param_dtype=variant.param_dtype, reduce_dtype=torch.float32)
    return shardwrap.ShardedModule(
        build_model(compile_blocks, variant),
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({models.Block}),
        mixed_precision=precision,
        **kwargs,
    )


def shardwrap_run(
    strategy: str,
    compile_blocks: bool,
    variant: Variant = Variant(),
    steps: Steps | None = None,
    *,
    after_wrap: bool = False,
    **kwargs,
) -> tuple[Run, shardwrap.ShardedModule]:
    """shardwrap on the test model; the run and the wrapped model."""
    sharded = shardwrap_model(strategy, compile_blocks and not after_wrap, variant, **kwargs)
    if after_wrap:
        for block in sharded.module.blocks:
            block.compile(fullgraph=True)
    return _train(sharded, dist.get_rank(), steps), sharded


def whole_model_run() -> tuple[Run, shardwrap.ShardedModule]:
    """``torch.compile`` on the wrapped model (eager blocks): graphs break at unit hooks."""
    sharded = shardwrap.ShardedModule(
        build_model(False), auto_wrap_policy=ModuleWrapPolicy({models.Block})
    )
    return _train(torch.compile(sharded), dist.get_rank()), sharded


def clip_shardwrap(model: shardwrap.ShardedModule) -> None:
    model.clip_grad_norm_(CLIP_NORM)


def clip_torch(model: nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)


def ledger_and_wire(model: shardwrap.ShardedModule, rank: int) -> tuple[float, int]:
    """One forward and backward: the ledger's gather and reduce bytes on a ring, and the
    bytes this rank really handed to ``ProcessGroup.send`` (gloo's pairwise collectives)."""
    counter = CollectiveCounter()
    counter.install()
    model.comm_ledger.reset()
    counter.counting = True
    models.gpt_loss(model, models.gpt_batch(rank)).backward()
    counter.counting = False
    model.zero_grad()
    moved = [r for r in model.comm_ledger.records if r.kind in ("all_gather", "reduce_scatter")]
    return sum(r.wire_bytes for r in moved), counter.reset().get("send", (0, 0))[1]


def checkpoint_round_trip(run: Run, sharded: shardwrap.ShardedModule, strategy: str) -> None:
    """Save the compiled model, load it into a new compiled one: the shards are equal."""
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    path = os.path.join(folder[0], "ckpt")
    save_checkpoint(path, sharded, run.optimizer)
    fresh = shardwrap_model(strategy, compile_blocks=True)
    optim = torch.optim.SGD(fresh.parameters(), lr=LR, momentum=0.9)
    load_checkpoint(path, fresh, optim)
    for mine, theirs in zip(sharded.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
    models.gpt_loss(fresh, models.gpt_batch(0)).backward()  # the loaded model trains
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])
