"""Rank workers for asynchronous checkpoint saves (tests/dist/test_checkpoint_async.py)."""

from __future__ import annotations

import copy
import errno
import os
import threading
import time

import torch

from shardwrap.ckpt import save as checkpoint_save
from shardwrap.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from shardwrap.ckpt import async_save, safetensors_writer
from tests import models
from tests.dist import parity
from tests.dist.ckpt_workers import (
    STEPS_PER_PHASE,
    _die_halfway,
    check_equals_snapshot,
    convert,
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
    return {k: b.data_ptr() for k, b in async_save.existing_saver(model).buffers.items()}


def train_while_saving(
    rank: int, world_size: int, strategy: str, first: str, second: str, alias: bool
) -> dict:
    """Train, save ``first`` asynchronously, train on while it is written, save ``second``.

    ``alias`` (the negative control): staging hands the writer the live tensors instead of
    copies. Returns this rank's pieces at each save and what the ranks observed.
    """
    torch.manual_seed(1234)
    model = models.TinyGPT()
    reference = copy.deepcopy(model)
    sharded = wrap(model, world_size, strategy)
    optim = parity.make_optimizer(sharded, "adamw")
    ref_optim = parity.make_optimizer(reference, "adamw")
    train_steps(sharded, optim, reference, ref_optim, world_size, rank, 0)
    at_first = local_pieces(sharded, optim)
    gate = threading.Event()
    original, gated = _gated_writes(gate)
    checkpoint_save.write_stream = gated
    staging = async_save.AsyncSaver.stage
    if alias:
        async_save.AsyncSaver.stage = lambda self, items: items
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
