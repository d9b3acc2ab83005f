"""Rank workers for the checkpoint tests: train, save, load, continue, compare.

A *snapshot* is what a sharded run held, assembled in the parent from every rank's local
pieces (independently of the checkpoint code): ``{"params": {name: full tensor},
"state": {name: {state: full tensor or value}}}``.
"""

from __future__ import annotations

import copy
import os
import signal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import shardwrap
from shardwrap.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from shardwrap.ckpt import save as checkpoint_save
from tests import models
from tests.dist import parity

STEPS_PER_PHASE = 2


def fresh_pair(world_size: int, strategy: str, persistence_threshold: int = 0) -> tuple:
    """A seeded TinyGPT wrapped under ``strategy`` and its unsharded copy, each with its
    AdamW: ``(sharded, optim, reference, ref_optim)``, for :func:`train_steps`."""
    torch.manual_seed(1234)
    model = models.TinyGPT()
    reference = copy.deepcopy(model)
    sharded = wrap(model, world_size, strategy, persistence_threshold)
    optim = parity.make_optimizer(sharded, "adamw")
    return sharded, optim, reference, parity.make_optimizer(reference, "adamw")


def wrap(
    model: nn.Module, world_size: int, strategy: str, persistence_threshold: int = 0
) -> shardwrap.ShardedModule:
    kwargs = {}
    if strategy.startswith("HYBRID"):
        kwargs["process_group"] = shardwrap.hybrid_process_groups(world_size // 2)
    return shardwrap.ShardedModule(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=parity.wrap_policy("gpt"),
        param_persistence_threshold=persistence_threshold,
        **kwargs,
    )


def local_pieces(sharded: shardwrap.ShardedModule, optim: torch.optim.Optimizer) -> dict:
    """This rank's pieces of every parameter and of its optimizer state."""
    pieces = {}
    for unit in sharded.units:
        handle = unit.handle
        if handle is None:
            continue
        layout_pieces = handle.layout.pieces(handle.shard_comm.rank)
        for info, piece, local in zip(handle.layout.params, layout_pieces, handle.shard_params):
            start, end = (
                (0, info.numel)
                if handle.num_shards == 1
                else (
                    piece.param_start,
                    piece.param_end,
                )
            )
            state = {
                k: v.detach().clone().reshape(-1) if v.dim() > 0 or k != "step" else v.clone()
                for k, v in optim.state.get(local, {}).items()
            }
            pieces[info.fqn] = (info.shape, start, end, local.detach().clone().reshape(-1), state)
    return pieces


def convert(obj, fn):
    """Apply ``fn`` to every tensor/array leaf (tensors cannot cross the result queue)."""
    if isinstance(obj, dict):
        return {k: convert(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(convert(v, fn) for v in obj)
    if isinstance(obj, torch.Tensor | np.ndarray):
        return fn(obj)
    return obj


def assemble(rank_pieces: list[dict]) -> dict:
    """Full tensors from every rank's pieces (the parent's independent view); numpy leaves."""
    return convert(_assemble(convert(rank_pieces, torch.from_numpy)), lambda t: t.numpy())


def _assemble(rank_pieces: list[dict]) -> dict:
    params, state = {}, {}
    for pieces in rank_pieces:
        for name, (shape, start, end, flat, local_state) in pieces.items():
            numel = torch.Size(shape).numel()
            params.setdefault(name, torch.full((numel,), float("nan")))[start:end] = flat
            for key, value in local_state.items():
                slot = state.setdefault(name, {})
                if value.dim() == 0 and key == "step":
                    slot[key] = value
                else:
                    slot.setdefault(key, torch.full((numel,), float("nan")))[start:end] = value
    for name, (shape, *_rest) in rank_pieces[0].items():
        params[name] = params[name].view(shape)
        for key, value in state.get(name, {}).items():
            if not (value.dim() == 0 and key == "step"):
                state[name][key] = value.view(shape)
    return {"params": params, "state": state}


def reference_from(snapshot: dict) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An unsharded model and optimizer holding exactly ``snapshot``."""
    torch.manual_seed(4321)
    reference = models.TinyGPT()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(snapshot["params"][name])
    optim = parity.make_optimizer(reference, "adamw")
    for name, param in reference.named_parameters():
        if name in snapshot["state"]:
            optim.state[param] = {k: v.clone() for k, v in snapshot["state"][name].items()}
    return reference, optim


def check_equals_snapshot(sharded, optim, snapshot: dict) -> None:
    """Right after a load, every local piece equals the snapshot's slice, bit for bit."""
    exact = {"rtol": 0.0, "atol": 0.0}
    for name, (_shape, start, end, flat, state) in local_pieces(sharded, optim).items():
        full = snapshot["params"][name].reshape(-1)
        torch.testing.assert_close(flat, full[start:end], **exact, msg=f"param {name}")
        expected_state = snapshot["state"].get(name, {})
        if set(state) != set(expected_state):
            raise AssertionError(f"{name}: state {sorted(state)} != {sorted(expected_state)}")
        for key, value in state.items():
            want = expected_state[key]
            want = want if want.dim() == 0 else want.reshape(-1)[start:end]
            torch.testing.assert_close(value, want, **exact, msg=f"state {name}/{key}")


def train_steps(
    sharded, optim, reference, ref_optim, world_size, rank, first_step, drifted_steps=0
) -> None:
    """``STEPS_PER_PHASE`` steps of both, checked after each (``parity.check_step``);
    ``drifted_steps``: the reordered steps the two already are apart by."""
    for offset, step in enumerate(range(first_step, first_step + STEPS_PER_PHASE)):
        batches = [parity.batch_for("gpt", 1000 * step + r) for r in range(world_size)]
        ref_loss = parity.loss_for("gpt", reference, parity.concat(batches), step)
        ref_loss.backward()
        grad_l1 = parity.gradient_l1(reference)
        ref_optim.step()
        ref_optim.zero_grad()
        loss = parity.loss_for("gpt", sharded, batches[rank], step)
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        parity.check_step(
            sharded, reference, mean_loss / world_size, ref_loss, world_size=world_size,
            optimizer="adamw", steps=drifted_steps + offset + 1, grad_l1=grad_l1,
        )  # fmt: skip


def phase(
    rank: int,
    world_size: int,
    strategy: str,
    load_from,
    save_to,
    snapshot,
    first_step,
    persistence_threshold: int = 0,
):
    """Build, load ``load_from`` (if any), check, train, save to ``save_to``; return pieces.

    ``persistence_threshold``: ``ShardedModule``'s ``param_persistence_threshold``.
    """
    if load_from is None:
        sharded, optim, reference, ref_optim = fresh_pair(
            world_size, strategy, persistence_threshold
        )
    else:
        torch.manual_seed(7 + first_step)  # a different init: the load must overwrite it
        sharded = wrap(models.TinyGPT(), world_size, strategy, persistence_threshold)
        optim = parity.make_optimizer(sharded, "adamw")
        extra = load_checkpoint(load_from, sharded, optim)
        assert extra == {"step": first_step, "note": "tuple→list", "pair": [1, 2]}, extra
        snapshot = convert(snapshot, torch.from_numpy)
        check_equals_snapshot(sharded, optim, snapshot)
        reference, ref_optim = reference_from(snapshot)
    train_steps(sharded, optim, reference, ref_optim, world_size, rank, first_step)
    next_step = first_step + STEPS_PER_PHASE
    save_checkpoint(
        save_to, sharded, optim, extra={"step": next_step, "note": "tuple→list", "pair": (1, 2)}
    )
    return convert(local_pieces(sharded, optim), lambda t: t.numpy())


def _die_halfway(path, items, metadata=None):
    """Stand-in for ``write_stream``: leave half a temporary file, then SIGKILL this rank."""
    folder, name = os.path.split(path)
    with open(os.path.join(folder, f".{name}.tmp"), "wb") as handle:
        handle.write(b"\0" * 64)
    os.kill(os.getpid(), signal.SIGKILL)


def crash_phase(rank: int, world_size: int, load_from: str, save_to: str, snapshot) -> None:
    """Load (into SHARD_GRAD_OP), train, then save with rank 1 killed while writing."""
    torch.manual_seed(5)
    sharded = wrap(models.TinyGPT(), world_size, "SHARD_GRAD_OP")
    optim = parity.make_optimizer(sharded, "adamw")
    load_checkpoint(load_from, sharded, optim)
    check_equals_snapshot(sharded, optim, convert(snapshot, torch.from_numpy))
    reference, ref_optim = reference_from(convert(snapshot, torch.from_numpy))
    train_steps(sharded, optim, reference, ref_optim, world_size, rank, STEPS_PER_PHASE)
    if rank == 1:
        checkpoint_save.write_stream = _die_halfway
    save_checkpoint(save_to, sharded, optim, extra={"step": 99})


def load_outcomes(rank: int, world_size: int, strategy: str, paths: list[str], snapshot):
    """Try to load each of ``paths``; 'ok' after checking against ``snapshot``, else the error."""
    outcomes = []
    for path in paths:
        torch.manual_seed(11)
        sharded = wrap(models.TinyGPT(), world_size, strategy)
        optim = parity.make_optimizer(sharded, "adamw")
        try:
            load_checkpoint(path, sharded, optim)
        except CheckpointError as exc:
            outcomes.append(str(exc))
            continue
        check_equals_snapshot(sharded, optim, convert(snapshot, torch.from_numpy))
        outcomes.append("ok")
    return outcomes


def pretrained_outcomes(rank: int, world_size: int, cases: list[tuple[str, str]], snapshot):
    """Load each Hugging Face-layout ``path``; check pieces against the snapshot in ``dtype``."""
    from shardwrap.ckpt.pretrained import load_pretrained

    snapshot = convert(snapshot, torch.from_numpy)
    for path, dtype in cases:
        torch.manual_seed(17)
        sharded = wrap(models.TinyGPT(), world_size, "FULL_SHARD")
        optim = parity.make_optimizer(sharded, "adamw")
        load_pretrained(sharded, path)
        rounded = {
            "params": {
                k: v.to(getattr(torch, dtype)).float() for k, v in snapshot["params"].items()
            },
            "state": {},
        }
        check_equals_snapshot(sharded, optim, rounded)
    return True
