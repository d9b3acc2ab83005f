"""Sharded safetensors checkpoints that survive crashes and load on any number of ranks.

``save_checkpoint`` runs on every rank: each rank writes the ranges it owns (see
``ckpt/slots.py``) of the parameters and of the optimizer state, then world rank 0 writes
the index (format: ``ckpt/format.py``, [Note: checkpoint layout]). ``load_checkpoint`` runs on
every rank of any world size and strategy: each rank computes the ranges it holds now and
reads only the pieces that overlap them.

Every rank reports success or its error to all others before anyone goes on, so a failure
on one rank raises on all of them instead of leaving the rest waiting in a collective.

The rest of saved state, by file (all in ``ckpt/``): loading (its checks, then its copy)
``loading.py``, reading ``reader.py``, writing safetensors ``safetensors_writer.py``,
optimizer state ``optim_state.py``, state dicts ``state_dict.py``, one-file export
``consolidate.py``, Hugging Face loading ``pretrained.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from typing import Any

import torch

from .base.gc_pause import gc_paused
from .ckpt import fragments, run_state
from .ckpt.entries import SavedPiece, group_pieces
from .ckpt.format import (
    INDEX_NAME,
    CheckpointError,
    CheckpointIndex,
    FileEntry,
    TensorEntry,
    check_coverage,
    dtype_name,
    index_bytes,
    read_index,
    remove_stale_files,
    shard_file_name,
    write_atomic,
)
from .ckpt.loading import Loading
from .ckpt.optim_state import (
    SCALAR,
    SHARDED,
    optimizer_class_name,
    optimizer_slots,
    state_kind,
)
from .ckpt.outcome import agree_on_id, check_json, guarded, settle
from .ckpt.safetensors_writer import StreamItem, write_stream
from .ckpt.slots import ModelSlots, ParamSlot, model_slots

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


# ------------------------------------------------------------------------------ save
def save_checkpoint(
    path: str | os.PathLike,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Any = None,
    sampler: Any = None,
) -> None:
    """Save ``model`` (and ``optimizer``) to the folder ``path``; call on every rank.

    ``extra`` is any JSON value (step, epoch, scheduler state); it comes back from
    :func:`load_checkpoint`. Every rank also records its random number generators and
    ``sampler.state_dict()`` (the data position, e.g. of a
    :class:`~shardwrap.data.sampler.ResumableSampler`) in a small file of its own
    ([Note: run state files]). The checkpoint becomes visible only once complete.
    """
    root = os.fspath(path)
    slots = model_slots(model)
    comm = slots.world_comm
    # One all-reduce agrees on rank 0's save id and on whether every rank may go on.

    def open_save() -> dict[str, Any]:
        run_state.check_sampler("sampler", sampler, "state_dict")
        return check_json("extra", extra)

    opening = guarded(open_save)
    save_id, failures = agree_on_id(comm, opening["error"] is not None)
    settle(comm, "save", root, opening, failures=failures)

    def write_rank() -> dict[str, Any]:
        report = _write_rank_file(root, save_id, slots, optimizer)
        run_state.write_run_file(root, save_id, comm.rank, comm.size, sampler)
        return report

    report = guarded(write_rank)
    written = [report.get("file"), run_state.run_file_name(save_id, comm.rank)]
    undo = lambda: _drop_uncommitted(root, save_id, written)  # noqa: E731
    # Only rank 0 receives the ranks' records (a gather): docs/checkpoint-format.md.
    reports = comm.gather_object(report, purpose="checkpoint")
    if comm.rank == 0:
        failed = [(rank, r["error"]) for rank, r in enumerate(reports) if r["error"]]
        if failed:
            report = {"error": "; ".join(f"rank {rank}: {error}" for rank, error in failed)}
        else:
            with gc_paused():  # millions of pieces at scale: see base/gc_pause.py
                report = guarded(
                    lambda: _commit_index(root, save_id, slots, optimizer, reports, extra, sampler)
                )
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


def _write_rank_file(
    root: str, save_id: str, slots: ModelSlots, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    items, records = _rank_items(slots, optimizer)
    # [Note: checkpoints of pipeline stages]; whole from each stage's lead, else a digest
    part = fragments.to_send(slots, fragments.fragment(slots, optimizer))
    os.makedirs(root, exist_ok=True)
    if not items:
        return {"file": None, "records": records, "fragment": part}
    name = shard_file_name(save_id, slots.world_comm.rank)
    written = write_stream(os.path.join(root, name), items, {"format": "pt", "save_id": save_id})
    entry = FileEntry(written.size, written.sha256, written.chunk_bytes, written.chunk_sha256)
    return {"file": name, "file_entry": entry.to_json(), "records": records, "fragment": part}


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


def _commit_index(
    root: str, save_id: str, slots: ModelSlots, optimizer, reports: list[dict], extra, sampler
) -> dict[str, Any]:
    """World rank 0, once every rank's file is durable: write the index, drop old files.

    The index describes the union of every rank's model ([Note: checkpoints of pipeline
    stages]).
    """
    reports = fragments.without_replicas(reports)  # [Note: replicas the model cannot see]
    pieces = _collect_pieces(reports)
    whole = fragments.merge(fragments.received([r["fragment"] for r in reports]))
    params = {
        name: _entry(name, tuple(shape), dtype, pieces[("param", name, None)], save_id)
        for name, (shape, dtype) in whole["params"].items()
    }
    buffers = {
        name: _entry(name, tuple(shape), dtype, pieces[("buffer", name, None)], save_id)
        for name, (shape, dtype) in whole["buffers"].items()
    }
    optim_state = param_groups = None
    if whole["groups"] is not None:
        optim_state, param_groups = _optimizer_entries(whole, pieces, save_id), whole["groups"]
    files = {
        r["file"]: FileEntry.from_json(r["file"], r["file_entry"]) for r in reports if r["file"]
    }
    index = CheckpointIndex(
        meta={
            "save_id": save_id,
            "world_size": slots.world_comm.size,
            "strategy": _strategy_name(slots),
            **({"optimizer_class": optimizer_class_name(optimizer)} if optimizer else {}),
            run_state.META_KEY: run_state.index_record(sampler),
        },
        params=params,
        aliases=whole["aliases"],
        buffers=buffers,
        optim_state=optim_state,
        param_groups=param_groups,
        files=files,
        extra=extra,
    )
    write_atomic(root, INDEX_NAME, index_bytes(index))
    remove_stale_files(root, keep=set(files), save_id=save_id)
    return {}


def _strategy_name(slots: ModelSlots) -> str | None:
    handles = [s.handle for s in slots.slots if s.handle is not None]
    return handles[0].strategy.name if handles else None


PieceMap = defaultdict[tuple[str, str, "str | None"], list[SavedPiece]]


def _collect_pieces(reports: list[dict]) -> PieceMap:
    """Every rank's saved pieces by ``(kind, name, state)``."""
    pieces: PieceMap = defaultdict(list)
    for rank, report in enumerate(reports):
        for kind, name, state, start, end, _, step, origin, at in report["records"]:
            key = (f"{kind}/{name}" if state is None else f"{kind}/{name}/{state}") + at
            saved = SavedPiece(rank, report["file"], key, start, end, step, origin)
            pieces[(kind, name, state)].append(saved)
    return pieces


def _entry(
    name: str, shape: tuple[int, ...], dtype: str, saved: list[SavedPiece], save_id: str
) -> TensorEntry:
    """An index entry; its pieces must tile the tensor (else the save is refused)."""
    entry = TensorEntry(shape, dtype, *group_pieces(saved, save_id))
    check_coverage(name, entry)
    return entry


def _optimizer_entries(
    whole: dict[str, Any], pieces: PieceMap, save_id: str
) -> dict[str, dict[str, Any]]:
    """Index entries of the optimizer state the merged fragments describe."""
    entries: dict[str, dict[str, Any]] = {}
    for fqn, states in whole["state"].items():
        for state, described in states.items():
            if "value" in described:
                entry: Any = {"value": described["value"]}
            else:
                refs = pieces[("optim", fqn, state)]
                shape = tuple(described["shape"])
                entry = _entry(f"{fqn}/{state}", shape, described["dtype"], refs, save_id)
            entries.setdefault(fqn, {})[state] = entry
    return entries


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
