"""Meta-device models materialised unit by unit; sync_module_states from rank 0."""

from __future__ import annotations

import weakref
import zlib

import pytest
import torch
from torch import nn

import shardwrap
from shardwrap.policies import ModuleWrapPolicy
from tests import models
from tests.dist.harness import STRATEGIES, WORLD_SIZES, run_ranks
from tests.dist.parity import (
    batch_for,
    check_shards,
    loss_for,
    make_optimizer,
    reordered_tol,
)

DEPTH, HIDDEN = 8, 64  # eight Linear units of <= 64*64+64 parameters each


def _meta_mlp() -> nn.Module:
    with torch.device("meta"):
        return models.MLP(dim=12, hidden=HIDDEN, depth=DEPTH)


class LiveTracker:
    """Bytes of materialised full parameters still alive, and the peak of that."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, size)

    def _release(self, size: int) -> None:
        self.live -= size


def named_init(names: dict[int, str], tracker: LiveTracker | None = None):
    """param_init_fn giving each parameter values seeded by its name (order independent)."""

    def init(module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for attr, param in module.named_parameters(recurse=False):
                seed = zlib.crc32(f"{names[id(module)]}.{attr}".encode())
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
                param.mul_(0.1)
                if tracker is not None:
                    tracker.add(param)

    return init


def _materialized_reference() -> nn.Module:
    reference = _meta_mlp()
    init = named_init({id(m): n for n, m in reference.named_modules()})
    for module in reference.modules():
        init(module)
    return reference


def _deferred_run(rank: int, world_size: int, strategy: str) -> dict:
    reference = _materialized_reference()
    meta = _meta_mlp()
    tracker = LiveTracker()
    sharded = shardwrap.ShardedModule(
        meta,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        param_init_fn=named_init({id(m): n for n, m in meta.named_modules()}, tracker),
    )
    check_shards(sharded, reference, exact=True)
    optim = torch.optim.SGD(sharded.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        batches = [models.mlp_batch(100 * step + r) for r in range(world_size)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        models.mlp_loss(reference, (x, y)).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        models.mlp_loss(sharded, batches[rank]).backward()
        optim.step()
        optim.zero_grad()
        # plain SGD at lr 0.1: parity's bound (with momentum and weight decay) holds a fortiori
        check_shards(sharded, reference, exact=False, tol=reordered_tol("sgd", step + 1, lr=0.1))
    largest_unit = (
        max(
            sum(p.numel() for p in m.parameters())
            for m in reference.modules()
            if isinstance(m, nn.Linear)
        )
        * 4
    )
    full_model = sum(p.numel() for p in reference.parameters()) * 4
    return {
        "peak": tracker.peak,
        "largest_unit": largest_unit,
        "full": full_model,
        "live_after": tracker.live,
    }


def _sync_eager(rank: int, world_size: int, strategy: str) -> None:
    torch.manual_seed(0)
    reference = models.TinyGPT()  # what rank 0 builds
    torch.manual_seed(0 if rank == 0 else 1000 + rank)  # the other ranks start elsewhere
    model = models.TinyGPT()
    sharded = shardwrap.ShardedModule(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({models.Block}),
        sync_module_states=True,
    )
    check_shards(sharded, reference, exact=True)
    optim, ref_optim = make_optimizer(sharded, "adamw"), make_optimizer(reference, "adamw")
    batches = [batch_for("gpt", r) for r in range(world_size)]
    loss_for("gpt", reference, tuple(torch.cat(p) for p in zip(*batches)), 0).backward()
    ref_optim.step()
    loss_for("gpt", sharded, batches[rank], 0).backward()
    optim.step()
    check_shards(sharded, reference, exact=False, tol=reordered_tol("adamw", 1))


def _sync_meta_default_init(rank: int, strategy: str) -> dict[str, list[float]]:
    torch.manual_seed(rank)  # reset_parameters draws different values on every rank
    sharded = shardwrap.ShardedModule(
        _meta_mlp(),
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        sync_module_states=True,
    )
    with sharded.summon_full_params(sharded, writeback=False):
        return {n: p.detach().reshape(-1).tolist() for n, p in sharded.named_parameters()}


def deferred_worker(rank: int, world_size: int) -> dict:
    out = {}
    for strategy in STRATEGIES:
        out[strategy] = _deferred_run(rank, world_size, strategy)
        _sync_eager(rank, world_size, strategy)
        out[strategy, "meta_sync"] = _sync_meta_default_init(rank, strategy)
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_deferred_init_unit_by_unit_and_sync(world_size):
    results = run_ranks(deferred_worker, world_size)
    for per_rank in results:
        for strategy in STRATEGIES:
            mem = per_rank[strategy]
            assert mem["full"] >= 5 * mem["largest_unit"], mem  # the test is meaningful
            # Never more than one unit's full parameters alive at once, none after wrapping.
            assert 0 < mem["peak"] <= mem["largest_unit"], (strategy, mem)
            assert mem["live_after"] == 0, (strategy, mem)
            values = per_rank[strategy, "meta_sync"]
            assert values == results[0][strategy, "meta_sync"], strategy
            assert any(v != 0.0 for v in values["body.0.weight"])


def bad_init_worker(rank: int, world_size: int) -> str:
    try:
        shardwrap.ShardedModule(_meta_mlp(), param_init_fn=lambda m: None)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_init_fn_that_leaves_meta_tensors_is_an_error():
    (message,) = run_ranks(bad_init_worker, 1)
    assert "meta" in message and "param_init_fn" in message, message
