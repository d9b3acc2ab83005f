"""Rank workers for asynchronous checkpoint saves (tests/dist/test_checkpoint_async.py)."""

from __future__ import annotations

import errno
import gc
import os
import threading
import time
import weakref

import torch

from shardwrap.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from shardwrap.ckpt import async_save, kinds, safetensors_writer, staging_plan
from shardwrap.ckpt import save as checkpoint_save
from shardwrap.ckpt.piece_records import SaveContext
from tests import models
from tests.dist import parity
from tests.dist.ckpt_workers import (
    STEPS_PER_PHASE,
    _die_halfway,
    check_equals_snapshot,
    convert,
    fresh_pair,
    local_pieces,
    reference_from,
    train_steps,
    wrap,
)

GATE_SECONDS = 0.3  # how long the first save's write is held back (the second must wait)
GATE_LIMIT = 60.0  # a gate never opened is a failed test, not a hang


def _gated_writes(gate: threading.Event):
    """``write_stream`` that starts only once ``gate`` is set: the background write then
    certainly runs after the training steps that follow the save."""
    original = checkpoint_save.write_stream

    def write_when_open(*args, **kwargs):
        if not gate.wait(GATE_LIMIT):
            raise RuntimeError("the test's gate never opened")
        return original(*args, **kwargs)

    return original, write_when_open


def _pointers(model) -> dict[str, int]:
    """Where each staged piece lies (the plan's views of its host arena)."""
    return {i.key: i.produce().data_ptr() for i in async_save.existing_saver(model).plan.items}


def _aliasing(stage):
    """``AsyncSaver.stage`` whose plan hands the writer the live tensors (the save
    functions' lazy views), not the staged copies: the negative control."""

    def stage_then_alias(self, model, optimizer, slots):
        plan = stage(self, model, optimizer, slots)
        ctx = SaveContext("", slots, optimizer, None)
        plan.items = kinds.save_all(ctx, kinds.TENSOR_KINDS).items
        return plan

    return stage_then_alias


def train_while_saving(
    rank: int, world_size: int, strategy: str, first: str, second: str, alias: bool
) -> dict:
    """Train, save ``first`` asynchronously, train on while it is written, save ``second``.

    ``alias`` (the negative control): staging hands the writer the live tensors instead of
    copies. Returns this rank's pieces at each save and what the ranks observed.
    """
    sharded, optim, reference, ref_optim = fresh_pair(world_size, strategy)
    train_steps(sharded, optim, reference, ref_optim, world_size, rank, 0)
    at_first = local_pieces(sharded, optim)
    gate = threading.Event()
    original, gated = _gated_writes(gate)
    checkpoint_save.write_stream = gated
    staging = async_save.AsyncSaver.stage
    if alias:
        async_save.AsyncSaver.stage = _aliasing(staging)
    try:
        handle = save_checkpoint(first, sharded, optim, extra={"step": 2}, asynchronous=True)
        pointers = _pointers(sharded)
        running = not handle.done()
        steps = STEPS_PER_PHASE  # the reference goes on with the run: apart by these steps
        train_steps(sharded, optim, reference, ref_optim, world_size, rank, steps, steps)
        at_second = local_pieces(sharded, optim)
        threading.Timer(GATE_SECONDS, gate.set).start()
        started = time.perf_counter()
        second_handle = save_checkpoint(
            second, sharded, optim, extra={"step": 4}, asynchronous=True
        )
        waited = time.perf_counter() - started
        first_done = handle.done()
        assert handle.result() == first
        second_handle.result()
    finally:
        checkpoint_save.write_stream = original
        async_save.AsyncSaver.stage = staging
    return {
        "pieces": [convert(p, lambda t: t.numpy()) for p in (at_first, at_second)],
        "running": running,
        "first_done_when_second_returned": first_done,
        "waited": waited,
        "same_buffers": bool(pointers) and pointers == _pointers(sharded),
    }


def matches_snapshot(rank: int, world_size: int, strategy: str, path: str, snapshot) -> bool:
    """Load ``path`` into a fresh model; whether it equals ``snapshot`` bit for bit."""
    torch.manual_seed(11)
    sharded = wrap(models.TinyGPT(), world_size, strategy)
    optim = parity.make_optimizer(sharded, "adamw")
    load_checkpoint(path, sharded, optim)
    try:
        check_equals_snapshot(sharded, optim, convert(snapshot, torch.from_numpy))
    except AssertionError:
        return False
    return True


def matches_snapshots(
    rank: int, world_size: int, strategy: str, paths: list[str], snapshots: list
) -> list[bool]:
    """:func:`matches_snapshot` for each of ``paths`` in turn, in one spawn."""
    return [
        matches_snapshot(rank, world_size, strategy, path, snapshot)
        for path, snapshot in zip(paths, snapshots, strict=True)
    ]


def _full_disk(temp, head, items, chunk_bytes):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def failing_background_write(rank: int, world_size: int, path: str) -> tuple:
    """A committed save to ``path``, then an asynchronous one whose write fails on rank 1
    (a full disk). Returns the error this rank's ``result()`` raised, the committed index
    (rank 0) and this rank's pieces at the committed save."""
    torch.manual_seed(3)
    sharded = wrap(models.TinyGPT(), world_size, "FULL_SHARD")
    optim = parity.make_optimizer(sharded, "adamw")
    save_checkpoint(path, sharded, optim)
    pieces = convert(local_pieces(sharded, optim), lambda t: t.numpy())
    index = open(os.path.join(path, "index.json"), "rb").read() if rank == 0 else None
    original = safetensors_writer._write_temp
    if rank == 1:
        safetensors_writer._write_temp = _full_disk
    try:
        handle = save_checkpoint(path, sharded, optim, asynchronous=True)
        try:
            handle.result()
        except CheckpointError as exc:
            return str(exc), index, pieces
    finally:
        safetensors_writer._write_temp = original
    raise AssertionError("the failed background write was not reported")


def async_crash_phase(rank: int, world_size: int, load_from: str, save_to: str, snapshot):
    """``ckpt_workers.crash_phase`` on the asynchronous path: rank 1 is killed while its
    background thread writes; rank 0 learns it from ``result()``."""
    torch.manual_seed(5)
    sharded = wrap(models.TinyGPT(), world_size, "SHARD_GRAD_OP")
    optim = parity.make_optimizer(sharded, "adamw")
    load_checkpoint(load_from, sharded, optim)
    check_equals_snapshot(sharded, optim, convert(snapshot, torch.from_numpy))
    reference, ref_optim = reference_from(convert(snapshot, torch.from_numpy))
    train_steps(sharded, optim, reference, ref_optim, world_size, rank, STEPS_PER_PHASE)
    if rank == 1:
        checkpoint_save.write_stream = _die_halfway
    handle = save_checkpoint(save_to, sharded, optim, extra={"step": 99}, asynchronous=True)
    handle.result()


def saves_across_layout_changes(
    rank: int, world_size: int, root: str, stale: bool, regroup: bool = True
) -> dict:
    """Four asynchronous saves of one model into ``root``/a..d, the layout changing before
    the second and third: ``a`` before any step (no optimizer state), ``b`` after two steps
    (the state appeared), ``c`` after resuming from ``b`` (``load_checkpoint`` gives the
    optimizer new state tensors) with half the learning rate, ``d`` with nothing changed,
    ``e`` with the last param group split in two (the parameters' order unchanged).

    ``stale`` (the negative control): the saver keeps its first plan whatever changed.
    Returns this rank's pieces at each call, the saver's plan count and arena after each.
    """
    sharded, optim, reference, ref_optim = fresh_pair(world_size, "FULL_SHARD")
    observed: dict[str, list] = {"pieces": [], "plans": [], "arenas": [], "lr": []}

    def save(name: str) -> None:
        handle = save_checkpoint(os.path.join(root, name), sharded, optim, asynchronous=True)
        observed["pieces"].append(convert(local_pieces(sharded, optim), lambda t: t.numpy()))
        observed["lr"].append(optim.param_groups[0]["lr"])
        handle.result()
        saver = async_save.existing_saver(sharded)
        observed["plans"].append(saver.num_plans)
        observed["arenas"].append(saver.plan.arena.data_ptr())

    fits = staging_plan.StagingPlan.fits
    if stale:
        staging_plan.StagingPlan.fits = lambda self, key: True
    try:
        save("a")
        train_steps(sharded, optim, reference, ref_optim, world_size, rank, 0)
        save("b")
        load_checkpoint(os.path.join(root, "b"), sharded, optim)
        for group in optim.param_groups:
            group["lr"] = group["lr"] / 2
        save("c")
        save("d")
        if not regroup:
            return observed
        # e: the same parameters, in the same order, the last group split in two (the
        # second part with another lr): only the groups' boundaries moved
        last = optim.param_groups[-1]
        moved = last["params"][-2:]
        last["params"] = last["params"][:-2]
        optim.param_groups.append({**last, "params": moved, "lr": last["lr"] / 4})
        save("e")
    finally:
        staging_plan.StagingPlan.fits = fits
    return observed


_WEAK_BY_MODULE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def saved_model_is_collected(rank: int, world_size: int, root: str, weak_map: bool) -> bool:
    """Whether an FSDP2 door model that trained and saved asynchronously is freed once the
    user drops it. Both the door's record of a call and the model's saver are kept per
    module; a value that reaches its module (the unit, the root, the slots) in a weak map
    keyed by that module keeps it for good. ``weak_map`` (the negative control): the
    door's record is also kept that way, as the door kept it before 2026-12-04."""
    import shardwrap
    from shardwrap.fsdp2.state import state_of

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    shardwrap.fully_shard(model)  # the root owns its parameters' unit
    if weak_map:
        _WEAK_BY_MODULE[model] = state_of(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    save_checkpoint(os.path.join(root, "ckpt"), model, optim, asynchronous=True).result()
    assert async_save.existing_saver(model).plan is not None
    dropped = weakref.ref(model)
    del model, optim
    gc.collect()
    freed = dropped() is None
    _WEAK_BY_MODULE.clear()
    return freed


_COLLECTIVES = (
    "all_reduce", "broadcast", "gather", "all_gather_object", "all_gather_single",
    "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
    "all_to_all_single", "monitored_barrier", "barrier", "isend", "irecv",
)  # fmt: skip


def _collectives_on_this_thread(call) -> list[str]:
    """The torch.distributed collectives ``call()`` issues from the calling thread."""
    import torch.distributed as dist

    me, seen, originals = threading.get_ident(), [], {}
    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def recording(*args, _name=name, _original=original, **kwargs):
            if threading.get_ident() == me:
                seen.append(_name)
            return _original(*args, **kwargs)

        originals[name] = original
        setattr(dist, name, recording)
    try:
        call()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return seen


def collectives_of_a_save_call(rank: int, world_size: int, root: str) -> dict:
    """The collectives the caller's thread issues in ``save_checkpoint``: asynchronous
    (after the model's first, which makes the background group) and, as the control that
    the recorder sees them, synchronous; and a bad ``extra`` on rank 1 only."""
    sharded, optim, reference, ref_optim = fresh_pair(world_size, "FULL_SHARD")
    train_steps(sharded, optim, reference, ref_optim, world_size, rank, 0)
    save_checkpoint(os.path.join(root, "a"), sharded, optim, asynchronous=True).result()
    handles = []
    found = {
        "async": _collectives_on_this_thread(
            lambda: handles.append(
                save_checkpoint(os.path.join(root, "b"), sharded, optim, asynchronous=True)
            )
        )
    }
    handles[0].result()
    found["sync"] = _collectives_on_this_thread(
        lambda: save_checkpoint(os.path.join(root, "c"), sharded, optim)
    )
    extra = {"bad": object()} if rank == 1 else {"step": 2}
    handle = save_checkpoint(
        os.path.join(root, "d"), sharded, optim, extra=extra, asynchronous=True
    )
    try:
        handle.result()
        found["bad_extra"] = ""
    except CheckpointError as exc:
        found["bad_extra"] = str(exc)
    return found
