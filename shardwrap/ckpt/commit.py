"""The index world rank 0 writes once every rank's file of a save is durable.

Every rank reports its file (size, digests) and the records of the pieces in it; rank 0
merges the reports into one :class:`~.format.CheckpointIndex`, whose pieces must tile every
tensor, writes it atomically (the moment the checkpoint becomes visible) and removes the
files of older saves. Called by ``save_checkpoint`` on the caller's thread, or on the
background thread of an asynchronous save (``async_save.py``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from . import fragments, run_state
from .entries import SavedPiece, group_pieces
from .format import (
    INDEX_NAME,
    CheckpointIndex,
    FileEntry,
    TensorEntry,
    check_coverage,
    index_bytes,
    remove_stale_files,
    write_atomic,
)
from .optim_state import optimizer_class_name
from .slots import ModelSlots


def commit_index(
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
