"""Sharded safetensors checkpoints that survive crashes and load on any number of ranks.

``save_checkpoint`` runs on every rank: each rank writes the ranges it owns (see
``ckpt/slots.py``) of the parameters and of the optimizer state, then world rank 0 writes
the index (format: ``ckpt/format.py``, [Note: checkpoint layout]). ``load_checkpoint`` runs on
every rank of any world size and strategy: each rank computes the ranges it holds now and
reads only the pieces that overlap them.

Every rank reports success or its error to all others before anyone goes on, so a failure
on one rank raises on all of them instead of leaving the rest waiting in a collective.

The rest of saved state, by file (all in ``ckpt/``): loading (its checks, then its copy)
``loading.py``, reading ``reader.py``, writing
safetensors ``safetensors_writer.py``, the index's commit ``commit.py``, saves in the
background ``async_save.py``, optimizer state ``optim_state.py``, state dicts
``state_dict.py``, one-file export ``consolidate.py``, Hugging Face loading
``pretrained.py``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from .base.gc_pause import gc_paused
from .base.validate import check_bool
from .ckpt import async_save, fragments, run_state
from .ckpt.async_save import AsyncSave
from .ckpt.commit import commit_index
from .ckpt.format import (
    CheckpointError,
    FileEntry,
    dtype_name,
    read_index,
    shard_file_name,
    write_atomic,
)
from .ckpt.loading import Loading
from .ckpt.optim_state import (
    SCALAR,
    SHARDED,
    optimizer_slots,
    state_kind,
)
from .ckpt.outcome import agree_on_id, check_json, guarded, settle
from .ckpt.safetensors_writer import StreamItem, write_stream
from .ckpt.slots import ModelSlots, ParamSlot, model_slots
from .comm.collectives import Communicator

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


# ------------------------------------------------------------------------------ save
def save_checkpoint(
    path: str | os.PathLike,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Any = None,
    sampler: Any = None,
    asynchronous: bool = False,
    on_commit: Callable[[], None] | None = None,
) -> AsyncSave | None:
    """Save ``model`` (and ``optimizer``) to the folder ``path``; call on every rank.

    ``extra`` is any JSON value (step, epoch, scheduler state); it comes back from
    :func:`load_checkpoint`. Every rank also records its random number generators and
    ``sampler.state_dict()`` (the data position, e.g. of a
    :class:`~shardwrap.data.sampler.ResumableSampler`) in a small file of its own
    ([Note: run state files]). The checkpoint becomes visible only once complete.

    With ``asynchronous`` (the same on every rank), the state is copied into host buffers
    and an :class:`~shardwrap.ckpt.async_save.AsyncSave` is returned at once; its files are
    written, hashed and committed in the background, and ``result()`` raises any failure
    ([Note: asynchronous saves]). Any save first waits for the model's save in flight.
    ``on_commit`` runs on world rank 0 once the index is written, before any rank learns
    that the save succeeded (its failure fails the save).
    """
    check_bool("asynchronous", asynchronous)
    if on_commit is not None and not callable(on_commit):
        raise TypeError(f"on_commit: expected a callable, got {type(on_commit).__name__}")
    root = os.fspath(path)
    slots = model_slots(model)
    comm = slots.world_comm
    async_save.wait_for_previous(model)

    def open_save() -> dict[str, Any]:
        run_state.check_sampler("sampler", sampler, "state_dict")
        return check_json("extra", extra)

    # One all-reduce agrees on rank 0's save id and on whether every rank may go on.
    opening = guarded(open_save)
    save_id, failures = agree_on_id(comm, opening["error"] is not None)
    settle(comm, "save", root, opening, failures=failures)
    saver = async_save.saver_of(model, comm) if asynchronous else None
    staged = guarded(lambda: _stage_rank(save_id, slots, optimizer, sampler, saver))
    if saver is not None:
        extra = json.loads(json.dumps(extra, allow_nan=True))  # as of now, not of the commit
    finish = functools.partial(
        _finish_save, root, save_id, slots, optimizer, staged, extra, sampler, on_commit
    )
    if saver is None:
        finish(comm)
        return None
    return saver.start(root, finish)


def _stage_rank(save_id: str, slots: ModelSlots, optimizer, sampler, saver) -> dict[str, Any]:
    """What this rank saves, as of now: its pieces (read lazily while writing, or copied to
    ``saver``'s host buffers), their records, its fragment and its run record."""
    items, records = _rank_items(slots, optimizer)
    # [Note: checkpoints of pipeline stages]; whole from each stage's lead, else a digest
    part = fragments.to_send(slots, fragments.fragment(slots, optimizer))
    run = run_state.run_file_bytes(save_id, slots.world_comm.rank, slots.world_comm.size, sampler)
    if saver is not None:
        items, part = saver.stage(items), copy.deepcopy(part)
    return {"items": items, "records": records, "fragment": part, "run": run}


def _finish_save(
    root, save_id, slots, optimizer, staged, extra, sampler, on_commit, comm: Communicator
) -> None:
    """Write this rank's files, gather the reports on ``comm``, commit on its rank 0."""
    rank = slots.world_comm.rank
    if staged["error"] is None:
        report = guarded(lambda: _write_rank_file(root, save_id, rank, staged))
    else:
        report = staged
    written = [report.get("file"), run_state.run_file_name(save_id, rank)]
    undo = lambda: _drop_uncommitted(root, save_id, written)  # noqa: E731
    # Only rank 0 receives the ranks' records (a gather): docs/checkpoint-format.md.
    reports = comm.gather_object(report, purpose="checkpoint")
    if comm.rank == 0:
        failed = [(rank, r["error"]) for rank, r in enumerate(reports) if r["error"]]
        if failed:
            report = {"error": "; ".join(f"rank {rank}: {error}" for rank, error in failed)}
        else:

            def commit() -> dict[str, Any]:
                commit_index(root, save_id, slots, optimizer, reports, extra, sampler)
                if on_commit is not None:
                    on_commit()
                return {}

            with gc_paused():  # millions of pieces at scale: see base/gc_pause.py
                report = guarded(commit)
    settle(comm, "save", root, report, undo)


def _drop_uncommitted(root: str, save_id: str, names: list[str | None]) -> None:
    """After a failed save: remove this rank's new files unless the index already names them."""
    try:
        committed = read_index(root).meta.get("save_id")
    except (OSError, CheckpointError):
        committed = None
    if committed != save_id:
        for name in filter(None, names):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(root, name))


def _write_rank_file(root: str, save_id: str, rank: int, staged: dict) -> dict[str, Any]:
    os.makedirs(root, exist_ok=True)
    report = {"file": None, "records": staged["records"], "fragment": staged["fragment"]}
    if staged["items"]:
        name = shard_file_name(save_id, rank)
        meta = {"format": "pt", "save_id": save_id}
        written = write_stream(os.path.join(root, name), staged["items"], meta)
        entry = FileEntry(written.size, written.sha256, written.chunk_bytes, written.chunk_sha256)
        report.update(file=name, file_entry=entry.to_json())
    write_atomic(root, *staged["run"])
    return report


def _rank_items(slots: ModelSlots, optimizer) -> tuple[list[StreamItem], list[tuple]]:
    """The 1-D pieces this rank saves (written lazily), and a record of each for the index:
    ``(kind, name, state, start, end, dtype, step, origin, key suffix)``; see
    :class:`SavedPiece` (the suffix tells a tensor-parallel block's pieces apart)."""
    items: list[StreamItem] = []
    records: list[tuple] = []
    is_rank0 = slots.leads  # the first data-parallel rank of this rank's stage

    def add(kind, name, state, value: torch.Tensor, start=0, at="", pattern=(0, 0)) -> None:
        key = (f"{kind}/{name}" if state is None else f"{kind}/{name}/{state}") + at
        flat = value.detach().reshape(-1)
        items.append(StreamItem(key, flat.dtype, (flat.numel(),), lambda flat=flat: flat))
        end = start + flat.numel()
        records.append((kind, name, state, start, end, dtype_name(flat.dtype), *pattern, at))

    def add_slot(kind: str, slot: ParamSlot, state: str | None, value: torch.Tensor) -> None:
        for at, piece, start in slot.saved_pieces(value):  # several for a TP block
            add(kind, slot.fqn, state, piece, start, at, _run_pattern(slot))

    for slot in slots.slots:
        if slot.saves and slot.end > slot.start:
            add_slot("param", slot, None, slot.local)
    if is_rank0:
        for name, buffer in slots.buffers.items():
            add("buffer", name, None, buffer)
    if optimizer is not None:
        for slot in (s for group in optimizer_slots(optimizer, slots) for s in group):
            for state, value in optimizer.state.get(slot.local, {}).items():
                kind = state_kind(slot, state, value)
                if kind == SHARDED and slot.saves and slot.end > slot.start:
                    add_slot("optim", slot, state, value)
                elif kind == SCALAR and is_rank0:
                    add("optim", slot.fqn, state, value)
    return items, records  # JSON values of the state go into the index from rank 0's own


def _run_pattern(slot: ParamSlot) -> tuple[int, int]:
    """``(step, origin)`` of a sharded slot's piece ([Note: piece runs]); ``(0, 0)`` for
    the rest, tensor-parallel blocks included (their pieces are listed)."""
    handle = slot.handle
    if handle is None or handle.num_shards == 1 or slot.tp is not None:
        return 0, 0
    step = handle.layout.shard_numel
    return step, handle.shard_comm.rank * step - handle.layout.params[slot.index].offset


# ------------------------------------------------------------------------------ load
def load_checkpoint(
    path: str | os.PathLike,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    sampler: Any = None,
    restore_rng: bool = True,
) -> Any:
    """Load a checkpoint saved at any world size and strategy; returns its ``extra``.

    Call on every rank. With ``strict``, parameters or buffers present on only one side
    are an error; without it they are skipped. ``sampler.load_state_dict`` gets the saved
    data position; with ``restore_rng`` every rank's random number generators continue
    where they were saved ([Note: run state files]; nothing for a checkpoint without them).
    """
    root = os.fspath(path)
    slots = model_slots(model)
    comm = slots.world_comm
    # Other pipeline stages' names ([Note: checkpoints of pipeline stages]).
    elsewhere = fragments.names_held_elsewhere(slots, [fragments.every_name(slots)])
    loading = Loading(
        root,
        slots,
        optimizer,
        strict=strict,
        sampler=sampler,
        restore_rng=restore_rng,
        elsewhere=elsewhere,
    )
    # Every rank checks all it will read before any rank changes anything, so a checkpoint
    # that one rank refuses leaves every rank as it was ([Note: a refused load changes
    # nothing] in ckpt/loading.py).
    try:
        settle(comm, "load", root, guarded(loading.check), loading.undo_trial)
        settle(comm, "load", root, guarded(loading.copy))
    finally:
        loading.close()
    if loading.run is not None:
        loading.run.restore_rng(comm.rank)
    return loading.index.extra  # type: ignore[union-attr]  # read by the check
