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

from . import fragments
from .entries import SavedPiece, group_pieces
from .format import (
    INDEX_NAME,
    CheckpointIndex,
    TensorEntry,
    check_coverage,
    index_bytes,
    remove_stale_files,
    write_atomic,
)
from .fragments import Described, Fragment
from .optim_state import optimizer_class_name
from .piece_records import RankReport, StateKind
from .slots import ModelSlots


def commit_index(
    root: str,
    save_id: str,
    slots: ModelSlots,
    optimizer,
    reports: list[RankReport],
    extra: Any,
    meta: dict[str, Any],
) -> None:
    """World rank 0, once every rank's file is durable: write the index, drop old files.

    The index describes the union of every rank's model ([Note: checkpoints of pipeline
    stages]); ``meta`` is what the state kinds add to its header (rank 0's own).
    """
    reports = fragments.without_replicas(reports)  # [Note: replicas the model cannot see]
    pieces = _collect_pieces(reports)
    whole = fragments.merge(fragments.received([r.fragment for r in reports]))  # type: ignore[misc]
    optim_state = param_groups = None
    if whole.groups is not None:
        optim_state, param_groups = _optimizer_entries(whole, pieces, save_id), whole.groups
    files = {r.file: r.file_entry for r in reports if r.file and r.file_entry}
    index = CheckpointIndex(
        meta={
            "save_id": save_id,
            "world_size": slots.world_comm.size,
            "strategy": _strategy_name(slots),
            **({"optimizer_class": optimizer_class_name(optimizer)} if optimizer else {}),
            **meta,
        },
        params=_entries(StateKind.PARAM, whole.params, pieces, save_id),
        aliases=whole.aliases,
        buffers=_entries(StateKind.BUFFER, whole.buffers, pieces, save_id),
        optim_state=optim_state,
        param_groups=param_groups,
        files=files,
        extra=extra,
    )
    write_atomic(root, INDEX_NAME, index_bytes(index))
    remove_stale_files(root, keep=set(files), save_id=save_id)


def _strategy_name(slots: ModelSlots) -> str | None:
    handles = [s.handle for s in slots.slots if s.handle is not None]
    return handles[0].strategy.name if handles else None


PieceMap = defaultdict[tuple[StateKind, str, "str | None"], list[SavedPiece]]


def _collect_pieces(reports: list[RankReport]) -> PieceMap:
    """Every rank's saved pieces by tensor: ``(kind, name, state)``."""
    pieces: PieceMap = defaultdict(list)
    for rank, report in enumerate(reports):
        for record in report.records:
            saved = SavedPiece(
                rank, report.file, record.key, record.start, record.end, record.step, record.origin
            )
            pieces[record.tensor].append(saved)
    return pieces


def _entries(
    kind: StateKind, described: dict[str, Described], pieces: PieceMap, save_id: str
) -> dict[str, TensorEntry]:
    return {
        name: _entry(name, d.shape, d.dtype, pieces[(kind, name, None)], save_id)
        for name, d in described.items()
    }


def _entry(
    name: str, shape: tuple[int, ...], dtype: str, saved: list[SavedPiece], save_id: str
) -> TensorEntry:
    """An index entry; its pieces must tile the tensor (else the save is refused)."""
    entry = TensorEntry(shape, dtype, *group_pieces(saved, save_id))
    check_coverage(name, entry)
    return entry


def _optimizer_entries(
    whole: Fragment, pieces: PieceMap, save_id: str
) -> dict[str, dict[str, Any]]:
    """Index entries of the optimizer state the merged fragments describe."""
    entries: dict[str, dict[str, Any]] = {}
    for fqn, states in whole.state.items():
        for state, described in states.items():
            if not described.tensor:
                entry: Any = {"value": described.value}
            else:
                refs = pieces[(StateKind.OPTIM, fqn, state)]
                entry = _entry(f"{fqn}/{state}", described.shape, described.dtype, refs, save_id)
            entries.setdefault(fqn, {})[state] = entry
    return entries
