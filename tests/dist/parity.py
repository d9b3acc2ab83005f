"""Train a sharded model and its unsharded reference side by side and compare them."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import shardwrap
from shardwrap.policies import ModuleWrapPolicy
from tests import models, tolerances


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


SGD = {"lr": 0.05, "momentum": 0.9}
WEIGHT_DECAY = 0.1  # on weights; biases and norms take none


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """``"adamw"``: AdamW with ``tolerances.REORDER_SAFE_ADAMW`` (so a run compared with a
    reordered reference has a bound, :func:`reordered_tol`); ``"sgd"``: SGD with momentum."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if name.endswith("bias") or "ln" in name else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, **SGD)
    if kind == "adamw":
        return torch.optim.AdamW(groups, **tolerances.REORDER_SAFE_ADAMW)
    raise ValueError(f"optimizer kind must be 'adamw' or 'sgd', got {kind!r}")


# TinyGPT's sums (the deeper of the two models here; the MLP's are shorter and shallower):
# 2 blocks of about 9 chained sums each way, then the final norm, head and loss, about 40
# deep; its longest sum is its MLP's 128-wide inner dimension or the batch's tokens.
TINY_GPT_CHAIN_DEPTH = 40
TINY_GPT_WIDEST_SUM = 128


# Above the largest gradient element TinyGPT and the MLP see in these runs (1.3 to 1.35:
# tests/unit/test_tolerances.py checks it); tolerances.GRAD_SCALE is the 3-D Llama's.
PARITY_GRAD_SCALE = 2.0


def reordered_relative(tokens: int = 0) -> float:
    """``tolerances.reordered_relative`` for TinyGPT (or the MLP) on ``tokens`` tokens."""
    terms = max(tokens, TINY_GPT_WIDEST_SUM)
    return tolerances.reordered_relative(terms, TINY_GPT_CHAIN_DEPTH)


def clipped_grad_multiple(
    numel: int, max_norm: float, norm_type: float = 2.0, tokens: int = 0
) -> float:
    """``reordered_tol``'s ``grad_multiple`` for gradients clipped to ``max_norm``.

    A clipped gradient is g * c, c = max_norm / norm <= 1: off by g's own bound plus
    g * c times the norm's relative error (``tolerances.reordered_norm_atol`` over the
    norm, which exceeds ``max_norm`` where clipping acts)."""
    relative = reordered_relative(tokens)
    norm_relative = tolerances.reordered_norm_atol(norm_type, numel, max_norm, relative) / max_norm
    return 1.0 + norm_relative / relative


def norm_tol(norm_type: float, model: nn.Module, norm: float, tokens: int = 0) -> dict:
    """``assert_close`` keywords for a gradient norm of ``model``'s trainable parameters."""
    numel = trainable_numel(model)
    atol = tolerances.reordered_norm_atol(norm_type, numel, float(norm), reordered_relative(tokens))
    return {"rtol": 0.0, "atol": atol}


def trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def reordered_tol(
    kind: str, num_steps: int, tokens: int = 0, grad_multiple: float = 1.0, lr: float = 0.0
) -> dict[str, float]:
    """``assert_close`` keywords for parameters after ``num_steps`` steps of
    :func:`make_optimizer`'s ``kind`` (``lr`` overrides its learning rate) against a
    reference that summed in another order. ``grad_multiple``: the gradients' scale in
    units of ``tolerances.GRAD_SCALE`` (2 for a doubled gradient; clipped ones:
    :func:`clipped_grad_multiple`)."""
    bound = {
        "relative": reordered_relative(tokens),
        "grad_scale": grad_multiple * PARITY_GRAD_SCALE,
    }
    if kind == "sgd":
        sgd = {**SGD, "lr": lr or SGD["lr"]}
        atol = tolerances.reordered_sgd_param_atol(
            num_steps, weight_decay=WEIGHT_DECAY, **sgd, **bound
        )
    else:
        lr = lr or tolerances.REORDER_SAFE_ADAMW["lr"]
        atol = tolerances.reordered_param_atol(num_steps, lr=lr, **bound)
    return {"rtol": tolerances.step_rounding_rtol(num_steps), "atol": atol}


def param_drift(model: nn.Module, tol: dict[str, float]) -> float:
    """The largest difference ``tol`` allows any of ``model``'s parameters."""
    largest = max(float(p.detach().abs().max()) for p in model.parameters())
    return tol["atol"] + tol["rtol"] * largest


def gradient_l1(model: nn.Module) -> float:
    """The sum of the magnitudes of ``model``'s gradients (for ``reordered_loss_atol``)."""
    return sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)


def batch_for(kind: str, seed: int):
    return models.gpt_batch(seed) if kind == "gpt" else models.mlp_batch(seed)


def loss_for(kind: str, model: nn.Module, batch, step: int) -> torch.Tensor:
    if kind == "gpt":
        return models.gpt_loss(model, batch, use_extra=step % 2 == 1)
    return models.mlp_loss(model, batch)


def batch_terms(kind: str, world_size: int) -> int:
    """Terms in a weight gradient's sum over the global batch of :func:`batch_for`."""
    inputs = batch_for(kind, 0)[0]
    per_rank = inputs.numel() if kind == "gpt" else inputs.shape[0]
    return world_size * per_rank


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

    Not ``exact``, ``tol`` (``rtol``/``atol``, e.g. :func:`reordered_tol`) is required: a
    reordered comparison takes a derived bound, never torch's default tolerance.
    """
    if not exact and tol is None:
        raise TypeError("check_shards(exact=False) needs tol: a bound from tests/tolerances.py")
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
            tols = {"rtol": 0.0, "atol": 0.0} if exact else tol
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


def check_step(
    sharded: shardwrap.ShardedModule,
    reference: nn.Module,
    mean_loss: torch.Tensor,
    ref_loss: torch.Tensor,
    *,
    world_size: int,
    optimizer: str,
    steps: int,
    grad_l1: float,
    model: str = "gpt",
) -> None:
    """After the reference's and the sharded model's ``steps``-th step (``mean_loss``: the
    ranks' mean of their losses at it): bit for bit on one rank, else the loss within
    ``reordered_loss_atol`` and each shard within :func:`reordered_tol`."""
    if world_size == 1:
        torch.testing.assert_close(mean_loss, ref_loss.detach(), rtol=0.0, atol=0.0)
        check_shards(sharded, reference, exact=True)
        return
    terms = batch_terms(model, world_size)
    # the loss came before this step: the parameters had drifted for steps - 1 steps
    drift = param_drift(reference, reordered_tol(optimizer, steps - 1, terms)) if steps > 1 else 0.0
    atol = tolerances.reordered_loss_atol(
        float(ref_loss.detach()), grad_l1, drift, reordered_relative(terms)
    )
    torch.testing.assert_close(mean_loss, ref_loss.detach(), rtol=0.0, atol=atol)
    check_shards(sharded, reference, False, reordered_tol(optimizer, steps, terms))


def optimizer_state_tol(key: str, world_size: int, optimizer: str = "adamw") -> dict:
    """``assert_close`` keywords for optimizer state ``key`` a few steps into a run compared
    with a reordered reference: a moment is a weighted mean of gradients (``exp_avg``,
    ``momentum_buffer``: off as much as a gradient) or of their squares (``exp_avg_sq``:
    twice the gradient's scale times that); ``step`` counts alike."""
    if world_size == 1 or key == "step":
        return {"rtol": 0.0, "atol": 0.0}
    grad_atol = reordered_relative() * PARITY_GRAD_SCALE
    if key in ("exp_avg", "momentum_buffer"):
        return {"rtol": 0.0, "atol": grad_atol}
    if key == "exp_avg_sq":
        return {"rtol": 0.0, "atol": 2.0 * PARITY_GRAD_SCALE * grad_atol}
    raise ValueError(f"no reordering bound for {optimizer} state {key!r}")


def train_and_compare(rank: int, world_size: int, case: Case) -> list[float]:
    model = build_model(case.model)
    for name in case.frozen:
        model.get_submodule(name).requires_grad_(False)
    reference = copy.deepcopy(model)
    sharded = wrap_case(model, case)
    optim = make_optimizer(sharded, case.optimizer)
    ref_optim = make_optimizer(reference, case.optimizer)
    losses = []
    for step in range(case.num_steps):
        batches = [batch_for(case.model, 1000 * step + r) for r in range(world_size)]
        ref_loss = loss_for(case.model, reference, concat(batches), step)
        ref_loss.backward()
        grad_l1 = gradient_l1(reference)
        ref_optim.step()
        ref_optim.zero_grad()
        loss = loss_for(case.model, sharded, batches[rank], step)
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world_size
        check_step(
            sharded, reference, mean_loss, ref_loss, world_size=world_size,
            optimizer=case.optimizer, steps=step + 1, grad_l1=grad_l1, model=case.model,
        )  # fmt: skip
        losses.append(float(ref_loss.detach()))
    return losses
