"""Train a sharded model and its unsharded reference side by side and compare them."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import shardwrap
from shardwrap.policies import ModuleWrapPolicy
from tests import models
from tests.tolerances import REORDER_SAFE_ADAMW


@dataclass(frozen=True)
class Case:
    strategy: str = "FULL_SHARD"
    model: str = "gpt"  # "gpt" | "mlp"
    nested: bool = True
    optimizer: str = "adamw"  # "adamw" | "sgd"
    hybrid_shard_size: int = 0  # >0: HYBRID groups of this many ranks
    num_steps: int = 3
    forward_prefetch: bool = False
    backward_prefetch: str | None = "BACKWARD_PRE"
    keep_root_gathered: bool = False  # set_reshard_after_forward(False) on the root
    reduce_bucket_bytes: int | None = None  # set_reduce_bucket_size; None: the default
    param_persistence_threshold: int = 0  # units under this many elements stay whole
    all_gather_bucket_bytes: int = 0  # set_all_gather_bucket_size
    frozen: tuple[str, ...] = ()  # submodules whose parameters are frozen before wrapping


def build_model(kind: str) -> nn.Module:
    torch.manual_seed(1234)
    return models.TinyGPT() if kind == "gpt" else models.MLP()


def wrap_policy(kind: str):
    return ModuleWrapPolicy({models.Block} if kind == "gpt" else {nn.Linear})


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if name.endswith("bias") or "ln" in name else decay).append(param)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    if kind == "reorder_safe_adamw":  # the bound of tests/tolerances.reordered_param_tol
        return torch.optim.AdamW(groups, **REORDER_SAFE_ADAMW)
    return torch.optim.AdamW(groups, lr=0.01)


def batch_for(kind: str, seed: int):
    return models.gpt_batch(seed) if kind == "gpt" else models.mlp_batch(seed)


def loss_for(kind: str, model: nn.Module, batch, step: int) -> torch.Tensor:
    if kind == "gpt":
        return models.gpt_loss(model, batch, use_extra=step % 2 == 1)
    return models.mlp_loss(model, batch)


def concat(batches):
    return tuple(torch.cat(parts) for parts in zip(*batches, strict=True))


def wrap_case(model: nn.Module, case: Case) -> shardwrap.ShardedModule:
    kwargs = {}
    if case.hybrid_shard_size:
        kwargs["process_group"] = shardwrap.hybrid_process_groups(case.hybrid_shard_size)
    sharded = shardwrap.ShardedModule(
        model,
        sharding_strategy=case.strategy,
        auto_wrap_policy=wrap_policy(case.model) if case.nested else None,
        forward_prefetch=case.forward_prefetch,
        backward_prefetch=case.backward_prefetch,
        param_persistence_threshold=case.param_persistence_threshold,
        **kwargs,
    )
    if case.keep_root_gathered:
        sharded.set_reshard_after_forward(False)
    if case.reduce_bucket_bytes is not None:
        sharded.set_reduce_bucket_size(case.reduce_bucket_bytes)
    sharded.set_all_gather_bucket_size(case.all_gather_bucket_bytes)
    return sharded


def check_shards(
    sharded: shardwrap.ShardedModule, reference: nn.Module, exact: bool, tol: dict | None = None
) -> None:
    """Each rank's shard views equal their slices of the reference parameters.

    ``tol`` (``rtol``/``atol``) overrides the default tolerance when not ``exact``.
    """
    ref = dict(reference.named_parameters())
    rank = None
    for unit in sharded.units:
        handle = unit.handle
        if handle is None:
            continue
        rank = handle.shard_comm.rank
        pieces = handle.layout.pieces(rank)
        for info, piece, shard in zip(handle.layout.params, pieces, handle.shard_params):
            expected = ref[info.fqn].detach().reshape(-1)[piece.param_start : piece.param_end]
            if handle.num_shards == 1:
                expected = ref[info.fqn].detach().reshape(-1)
            tols = {"rtol": 0.0, "atol": 0.0} if exact else (tol or {})
            torch.testing.assert_close(
                shard.detach().reshape(-1), expected, msg=lambda m, f=info.fqn: f"{f}: {m}", **tols
            )


def max_shard_difference(sharded: shardwrap.ShardedModule, reference: nn.Module) -> float:
    """The largest elementwise difference between the shard views and their reference slices."""
    ref = dict(reference.named_parameters())
    worst = 0.0
    for unit in sharded.units:
        handle = unit.handle
        if handle is None:
            continue
        pieces = handle.layout.pieces(handle.shard_comm.rank)
        for info, piece, shard in zip(handle.layout.params, pieces, handle.shard_params):
            full = ref[info.fqn].detach().reshape(-1)
            expected = full if handle.num_shards == 1 else full[piece.param_start : piece.param_end]
            if expected.numel():
                worst = max(worst, float((shard.detach().reshape(-1) - expected).abs().max()))
    return worst


def train_and_compare(rank: int, world_size: int, case: Case) -> list[float]:
    model = build_model(case.model)
    for name in case.frozen:
        model.get_submodule(name).requires_grad_(False)
    reference = copy.deepcopy(model)
    sharded = wrap_case(model, case)
    optim = make_optimizer(sharded, case.optimizer)
    ref_optim = make_optimizer(reference, case.optimizer)
    exact = world_size == 1
    losses = []
    for step in range(case.num_steps):
        batches = [batch_for(case.model, 1000 * step + r) for r in range(world_size)]
        ref_loss = loss_for(case.model, reference, concat(batches), step)
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        loss = loss_for(case.model, sharded, batches[rank], step)
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world_size
        tol = {"rtol": 0.0, "atol": 0.0} if exact else {}
        torch.testing.assert_close(mean_loss, ref_loss.detach(), **tol)
        check_shards(sharded, reference, exact)
        losses.append(float(ref_loss.detach()))
    return losses
