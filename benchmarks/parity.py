"""Train DDP and shardwrap strategies from the same weights and batches; compare them.

Used by ``bench_parity.py`` (the benchmark's numerics check) and by the parity matrix
test. Everything runs inside an initialised process group; each call builds a fresh
model with :func:`benchmarks.gpt.build`, so every implementation starts from the same
weights, and every rank reads its own batch of each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks import gpt
from benchmarks.optimizers import OptimizerFactory

# Every strategy shardwrap offers; hybrids need their shard size (see ``wrap``).
STRATEGIES = (
    "FULL_SHARD",
    "SHARD_GRAD_OP",
    "SHARD_OPTIM",
    "NO_SHARD",
    "HYBRID_SHARD",
    "HYBRID_SHARD_ZERO2",
)


@dataclass(frozen=True)
class Run:
    """One training run: the mean loss of each step and the full state at the end."""

    losses: list[float]
    state: dict[str, torch.Tensor]


def grouped_allreduce_hook(groups: tuple, bucket):  # DDP rejects a string annotation
    """A DDP comm hook that sums each gradient bucket as a hybrid strategy does: over
    ``groups[0]`` (the shard group), then over ``groups[1]`` (the replicas), then divides
    by the world size. DDP's own all-reduce adds the ranks' terms in gloo's ring order,
    which depends on the element's position; this order is the hybrid's, so the two agree
    bit for bit instead of within a rounding bound."""
    tensor = bucket.buffer()
    for group in groups:
        dist.all_reduce(tensor, group=group)
    tensor.div_(dist.get_world_size())
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def wrap(
    model: nn.Module, impl: str, *, hybrid_shard_size: int = 0, ddp_groups=None, **options
) -> nn.Module:
    """``model`` wrapped by DDP (``impl == "DDP"``; with ``ddp_groups``, summing through
    :func:`grouped_allreduce_hook`) or by shardwrap with strategy ``impl`` and further
    ``ShardedModule`` ``options``.
    """
    if impl == "DDP":
        ddp = DistributedDataParallel(model)
        if ddp_groups is not None:
            ddp.register_comm_hook(tuple(ddp_groups), grouped_allreduce_hook)
        return ddp
    import shardwrap
    from shardwrap.wrap import ModuleWrapPolicy

    kwargs = dict(options)
    if impl.startswith("HYBRID"):
        kwargs["process_group"] = shardwrap.hybrid_process_groups(hybrid_shard_size)
    return shardwrap.ShardedModule(
        model,
        sharding_strategy=impl,
        auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
        **kwargs,
    )


def train(
    config: gpt.GPTConfig,
    impl: str,
    make_optimizer: OptimizerFactory,
    *,
    num_steps: int,
    batch_size: int = 2,
    hybrid_shard_size: int = 0,
    ddp_groups=None,
    **options,
) -> Run:
    """Train ``impl`` for ``num_steps`` steps on this rank's batches; losses are means over
    ranks, the state is the full (unsharded) state dict after the last step. ``options``
    go to ``ShardedModule``.
    """
    model = gpt.build(config)
    wrapped = wrap(
        model, impl, hybrid_shard_size=hybrid_shard_size, ddp_groups=ddp_groups, **options
    )
    optimizer = make_optimizer(wrapped)
    losses = train_losses(wrapped, optimizer, config, num_steps, batch_size)
    source = model if impl == "DDP" else wrapped
    state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    return Run(losses, state)


def train_losses(model, optimizer, config, num_steps: int, batch_size: int) -> list[float]:
    """``num_steps`` steps of ``model`` on this rank's batches; each step's loss, averaged
    over the ranks."""
    rank = dist.get_rank()
    losses = []
    for step in range(num_steps):
        inputs, targets = gpt.batch(config, step=step, rank=rank, batch_size=batch_size)
        loss = gpt.loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def differences(run: Run, reference: Run, *, tolerance: dict[str, float] | None) -> list[str]:
    """What differs between two runs: bit for bit when ``tolerance`` is None, else beyond
    ``rtol``/``atol`` as ``torch.testing.assert_close`` counts them. Empty when they agree.
    """
    rtol, atol = (0.0, 0.0) if tolerance is None else (tolerance["rtol"], tolerance["atol"])
    found = []
    for step, (loss, ref) in enumerate(zip(run.losses, reference.losses, strict=True)):
        if not abs(loss - ref) <= atol + rtol * abs(ref):  # NaN differs too
            found.append(f"loss of step {step + 1}: {loss!r} vs {ref!r}")
            break
    for name, expected in reference.state.items():
        actual = run.state.get(name)
        if actual is None:
            found.append(f"{name}: missing from the state dict")
            continue
        same = (
            torch.equal(actual, expected)
            if tolerance is None
            else torch.allclose(actual, expected, rtol=rtol, atol=atol)
        )
        if not same:
            found.append(f"{name}: max abs diff {(actual - expected).abs().max().item():.3e}")
    return found
