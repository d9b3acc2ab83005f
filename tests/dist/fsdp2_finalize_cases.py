"""Rank workers for tests/dist/test_fsdp2_finalize.py: torch 2.15's manual backward
finalization and ``set_keep_unsharded_storage``, on torch's FSDP2 and on shardwrap's door.

One script (tests/dist/fsdp2_cases.py's model, batches, AdamW, clipping and per-step
record), its step written several ways (:data:`STEPS`); each run returns the
``fsdp2_cases.Record`` that ``fsdp2_cases.differences`` compares.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardwrap
from shardwrap.fsdp2.state import state_of
from tests.dist import fsdp2_cases as fc


def _loss(model: nn.Module, step: int, micro: int, rank: int) -> torch.Tensor:
    idx, target = fc.batch(10 * step + micro, rank)
    return F.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1))


def _backward(model: nn.Module, step: int, micro: int, rank: int) -> float:
    loss = _loss(model, step, micro, rank)
    loss.backward()
    return float(loss.detach())


def single(model, step: int, rank: int) -> float:
    """One backward, the automatic end."""
    return _backward(model, step, 0, rank)


def single_finalized(model, step: int, rank: int) -> float:
    """One backward, then ``finalize_backward()``."""
    loss = _backward(model, step, 0, rank)
    model.finalize_backward()
    return loss


def accumulated(model, step: int, rank: int) -> float:
    """Two microbatches, the first without gradient sync, the automatic end."""
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        loss = _backward(model, step, micro, rank)
    return loss


def accumulated_finalized(model, step: int, rank: int) -> float:
    """FSDP2's documented use: two backwards without sync, sync back on, then
    ``finalize_backward(async_op=True)`` and the handle's ``wait()``."""
    model.set_requires_gradient_sync(False)
    for micro in range(2):
        loss = _backward(model, step, micro, rank)
    model.set_requires_gradient_sync(True)
    model.finalize_backward(async_op=True).wait()
    return loss


def synced_finalized(model, step: int, rank: int) -> float:
    """Two synchronising backwards, then one ``finalize_backward()``: the units autograd
    reached reduce in each, the root (not reached: its inputs are token ids) only once."""
    for micro in range(2):
        loss = _backward(model, step, micro, rank)
    model.finalize_backward()
    return loss


def synced(model, step: int, rank: int) -> float:
    """Two synchronising backwards, the automatic end after each."""
    for micro in range(2):
        loss = _backward(model, step, micro, rank)
    return loss


def never_finalized(model, step: int, rank: int) -> float:
    """The negative control: manual finalization on, ``finalize_backward`` never called."""
    return _backward(model, step, 0, rank)


STEPS = {
    f.__name__: f
    for f in (
        single,
        single_finalized,
        accumulated,
        accumulated_finalized,
        synced,
        synced_finalized,
        never_finalized,
    )
}
MANUAL = {"single_finalized", "accumulated_finalized", "synced_finalized", "never_finalized"}


def undeferred_fully_shard(module: nn.Module, **kwargs) -> nn.Module:
    """The negative control of manual finalization: shardwrap's ``fully_shard`` whose
    end-of-backward callback does not leave the units autograd did not reach waiting
    (it reduces them at every backward's end, as without manual finalization)."""
    shardwrap.fully_shard(module, **kwargs)
    runtime = state_of(module).root.runtime

    def end_backward() -> None:
        runtime.backward_in_flight = False
        runtime._end_backward(last=not runtime.manual.active and runtime.is_last_backward)

    runtime.finalize_backward = end_backward
    return module


SIDES = {
    "torch": torch_fsdp.fully_shard,
    "shardwrap": shardwrap.fully_shard,
    "undeferred": undeferred_fully_shard,
}


def run(
    side: str,
    rank: int,
    world_size: int,
    step_name: str,
    keep: bool = False,
    blocks_reshard: bool = True,
):
    """The script on ``SIDES[side]`` as its ``fully_shard``, each step
    ``STEPS[step_name]`` (manual finalization on for those in :data:`MANUAL`); ``keep``:
    ``set_keep_unsharded_storage(True)`` on the root; ``blocks_reshard``: the blocks'
    ``reshard_after_forward``. The record, and what :class:`_FullStorage` saw."""
    shard = SIDES[side]
    torch.manual_seed(0)
    model = fc.TinyModel()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for block in model.blocks:
        shard(block, mesh=mesh, reshard_after_forward=blocks_reshard)
    shard(model, mesh=mesh)
    if step_name in MANUAL:
        model.set_manual_backward_finalization(True)
    if keep:
        model.set_keep_unsharded_storage(True)
    storage = _FullStorage(model.blocks[0].up)
    optim = torch.optim.AdamW(model.parameters(), lr=fc.LR, weight_decay=0.1)
    record = fc.Record()
    for step in range(fc.NUM_STEPS):
        loss = STEPS[step_name](model, step, rank)
        sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
        record.grad_is_dtensor &= all(isinstance(p.grad, DTensor) for p in sharded)
        record.grad_norms.append(fc._plain(torch.nn.utils.clip_grad_norm_(sharded, fc.CLIP_NORM)))
        optim.step()
        optim.zero_grad()
        storage.after_step()
        record.losses.append(loss)
        fc._read(model, record)
    seen = storage.seen()
    root = state_of(model)
    ledger = root.root.comm_ledger.records if root is not None and root.root is not None else []
    # The door's parameter all-gathers (None on torch's, which keeps no ledger).
    gathers = [r for r in ledger if (r.kind, r.purpose) == ("all_gather", "params")]
    seen["gathers"] = len(gathers) if root is not None else None
    return record, seen


class _FullStorage:
    """What a block's gathered weight (as its forward sees it) holds after each step: its
    storage's bytes (0: freed) and data pointer."""

    def __init__(self, module: nn.Module) -> None:
        self.param: torch.Tensor | None = None
        self.sizes: list[int] = []
        self.pointers: list[int] = []
        module.register_forward_pre_hook(self._capture)

    def _capture(self, module: nn.Module, args: tuple) -> None:
        self.param = module.weight  # the full parameter while the unit is gathered

    def after_step(self) -> None:
        storage = self.param.untyped_storage()  # type: ignore[union-attr]
        self.sizes.append(storage.size())
        self.pointers.append(storage.data_ptr())

    def seen(self) -> dict:
        return {"sizes": self.sizes, "pointers": self.pointers}


def compare(rank: int, world_size: int, pairs: list[tuple]) -> list[dict]:
    """For each ``(reference, ours)``, both ``(side, step_name, keep)``: the differences
    between the two runs' records (or the error ours raised), and each run's storage."""
    found = []
    for reference_run, our_run in pairs:
        dist.barrier()
        reference, reference_storage = run(reference_run[0], rank, world_size, *reference_run[1:])
        dist.barrier()
        try:
            ours, our_storage = run(our_run[0], rank, world_size, *our_run[1:])
        except (RuntimeError, AttributeError) as error:  # alike on every rank, in step
            found.append({"error": f"{type(error).__name__}: {str(error)[:300]}"})
            continue
        found.append(
            {
                "differences": fc.differences(reference, ours),
                "storage": {"reference": reference_storage, "ours": our_storage},
            }
        )
    return found


def misuse(rank: int, world_size: int, side: str) -> dict[str, str]:
    """What each misuse gets from ``side``'s ``fully_shard`` ("torch" or "shardwrap"),
    by name: its error, or "accepted"."""
    found = {}

    def attempt(name: str, call) -> None:
        try:
            call()
        except (RuntimeError, TypeError) as error:
            found[name] = f"{type(error).__name__}: {error}"
        else:
            found[name] = "accepted"

    model = fc.sharded_tiny(side, world_size)
    attempt("before_forward", lambda: model.finalize_backward())
    if side == "shardwrap":  # torch's takes any value
        attempt("enabled_not_bool", lambda: model.set_manual_backward_finalization(1))
    _backward(model, 0, 0, rank)
    attempt("on_a_block", lambda: model.blocks[0].set_manual_backward_finalization(True))
    attempt("without_the_mode", lambda: model.finalize_backward())
    model.set_manual_backward_finalization(True)
    _backward(model, 0, 0, rank)
    attempt("mode_changed_mid_step", lambda: model.set_manual_backward_finalization(False))
    handle = model.finalize_backward(async_op=True)
    attempt("forward_before_wait", lambda: _loss(model, 0, 0, rank))
    attempt("finalize_before_wait", lambda: model.finalize_backward())
    handle.wait()
    attempt("twice", lambda: model.finalize_backward())
    attempt("during_backward", lambda: _backward_calling(model, rank, model.finalize_backward))
    model.reset_iter_state()
    unset = functools.partial(model.set_manual_backward_finalization, False)
    attempt("set_during_backward", lambda: _backward_calling(model, rank, unset))
    model.reset_iter_state()
    attempt("off_the_root", lambda: model.blocks[0].finalize_backward())
    stale = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    attempt("handle_after_reset", stale.wait)
    if side == "shardwrap":  # torch's raises at the first forward instead
        attempt("set_on_a_root_adopted_later", lambda: _adopted(world_size))
    return found


def _adopted(world_size: int) -> None:
    """Manual finalization set on a block while it was a root, then the model sharded."""
    model = fc.TinyModel()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        shardwrap.fully_shard(block, mesh=mesh)
    model.blocks[0].set_manual_backward_finalization(True)
    shardwrap.fully_shard(model, mesh=mesh)


def _backward_calling(model: nn.Module, rank: int, call) -> None:
    """A backward during which a hook on the model's output (run after FSDP's own, which
    starts the backward) calls ``call()``."""
    idx, target = fc.batch(0, rank)
    out = model(idx)
    out.register_hook(lambda grad: call())
    F.cross_entropy(out.reshape(-1, fc.OUT), target.reshape(-1)).backward()


def hsdp_partial(rank: int, world_size: int, side: str) -> str:
    """Manual finalization on a (2, 2) HSDP mesh with the all-reduce skipped
    (``set_requires_all_reduce(False)``): the blocks keep their reduce-scatter sums, so
    ``finalize_backward`` must refuse, as FSDP2's does. What it raised ("" if nothing)."""
    shard = SIDES[side]
    torch.manual_seed(0)
    model = fc.TinyModel()
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    model.set_requires_all_reduce(False)
    model.set_manual_backward_finalization(True)
    _backward(model, 0, 0, rank)
    try:
        model.finalize_backward()
    except RuntimeError as error:
        return f"RuntimeError: {error}"
    finally:
        dist.barrier()
    return ""
