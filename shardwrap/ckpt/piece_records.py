"""The records a checkpoint save passes around: what kind of state, which piece, whose report.

[Note: state kinds]
Everything a checkpoint holds is of one :class:`StateKind`. A kind's value is what it is
called on disk (the first part of a piece's key in the safetensors files, ``param/...``),
so these strings appear here and nowhere else. Each kind has a save function (what one
rank contributes: pieces for its safetensors file, files of its own, index metadata) and
a load function (its checks before anything changes, then its copy), listed by kind in
``ckpt/kinds.py``; see docs/checkpoint-format.md, "Adding a state kind".

A :class:`PieceRecord` describes one saved piece; a :class:`RankReport` is what a saving
rank sends world rank 0. Both are typed in memory and turn into plain JSON values only at
the gather (:meth:`RankReport.to_json`): rank 0 parses each rank's report back before it
builds the index, so a malformed one is refused with the rank that sent it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from .entries import CheckpointError, FileEntry, TensorEntry
from .format import CheckpointIndex
from .reader import CheckpointReader
from .safetensors_writer import StreamItem
from .slots import ModelSlots, ParamSlot


class StateKind(enum.Enum):
    """What a saved piece (or a rank's own file) holds; the value is its name on disk."""

    PARAM = "param"  # a range of a parameter (each rank the range it owns)
    BUFFER = "buffer"  # a whole buffer (each pipeline stage's first data-parallel rank)
    OPTIM = "optim"  # a range of an optimizer state tensor, or a whole scalar one
    RUN = "run"  # a rank's random streams and data position (ckpt/run_state.py)


def piece_key(kind: StateKind, name: str, state: str | None, at: str = "") -> str:
    """The key of a piece in its rank's safetensors file: ``kind/name[/state]`` then ``at``
    (which tells a tensor-parallel block's pieces apart). Built here only."""
    return (f"{kind.value}/{name}" if state is None else f"{kind.value}/{name}/{state}") + at


@dataclass(frozen=True, slots=True)
class PieceRecord:
    """One piece a rank saves: elements ``[start, end)`` of tensor ``name`` (optimizer
    state ``state`` of it, for :attr:`StateKind.OPTIM`), flattened.

    ``step``/``origin`` describe its unit's shard ([Note: piece runs] in entries.py; ``step``
    0: a piece outside any run, such as a buffer).
    """

    kind: StateKind
    name: str
    state: str | None
    start: int
    end: int
    dtype: str
    step: int = 0
    origin: int = 0  # the parameter element where this rank's shard would start
    at: str = ""  # a tensor-parallel block's piece suffix

    @property
    def key(self) -> str:
        return piece_key(self.kind, self.name, self.state, self.at)

    @property
    def tensor(self) -> tuple[StateKind, str, str | None]:
        """Which saved tensor the piece is of."""
        return self.kind, self.name, self.state

    def to_json(self) -> list[Any]:
        """A list, not an object: rank 0 receives one per piece of the job."""
        kind, name, state = self.kind.value, self.name, self.state
        return [
            kind,
            name,
            state,
            self.start,
            self.end,
            self.dtype,
            self.step,
            self.origin,
            self.at,
        ]

    @staticmethod
    def from_json(raw: Any) -> PieceRecord:
        kind, name, state, start, end, dtype, step, origin, at = raw
        names = (name, dtype, at, "" if state is None else state)
        if not all(isinstance(t, str) for t in names):
            raise TypeError(f"a piece record's names must be strings: {raw!r}")
        if not all(type(n) is int for n in (start, end, step, origin)):
            raise TypeError(f"a piece record's bounds must be integers: {raw!r}")
        return PieceRecord(StateKind(kind), name, state, start, end, dtype, step, origin, at)


@dataclass(frozen=True, slots=True)
class SentFragment:
    """What a rank sends rank 0 of its model's description ([Note: checkpoints of pipeline
    stages] in fragments.py): its digest, and the whole of it from a stage's lead only.
    ``fragment`` stays JSON: rank 0 merges it with the others as such."""

    digest: str
    fragment: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "fragment": self.fragment}

    @staticmethod
    def from_json(raw: Any) -> SentFragment:
        digest, part = raw["digest"], raw["fragment"]
        if not isinstance(digest, str) or not (part is None or isinstance(part, dict)):
            raise TypeError(f"a fragment must be a digest and an object or null, got {raw!r}")
        return SentFragment(digest, part)


@dataclass(frozen=True, slots=True)
class RankReport:
    """What a saving rank reports to world rank 0: its failure, or its file and pieces."""

    error: str | None
    file: str | None = None  # its safetensors file; None when it saved no piece
    file_entry: FileEntry | None = None  # the file's size and checksums
    records: tuple[PieceRecord, ...] = ()
    fragment: SentFragment | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "error": self.error,
            "file": self.file,
            "file_entry": None if self.file_entry is None else self.file_entry.to_json(),
            "records": [r.to_json() for r in self.records],
            "fragment": None if self.fragment is None else self.fragment.to_json(),
        }

    @staticmethod
    def from_json(rank: int, raw: Any) -> RankReport:
        """Rank ``rank``'s report as gathered; a malformed one names the rank."""
        try:
            if raw["error"] is not None:
                return RankReport(str(raw["error"]))
            file = raw["file"]
            entry = None if file is None else FileEntry.from_json(file, raw["file_entry"])
            records = tuple(PieceRecord.from_json(r) for r in raw["records"])
            fragment = SentFragment.from_json(raw["fragment"])
            return RankReport(None, file, entry, records, fragment)
        except (KeyError, TypeError, ValueError, CheckpointError) as exc:
            raise CheckpointError(f"rank {rank}: its save report is malformed: {exc!r}") from exc

    def without_pieces(self) -> RankReport:
        """This report with no pieces and no file (a replica's: fragments.without_replicas)."""
        return RankReport(self.error, None, None, (), self.fragment)


# ----------------------------------------------------------- what a state kind is given
@dataclass(frozen=True, slots=True)
class SaveContext:
    """What a state kind's save function reads on one rank (as of the call)."""

    save_id: str
    slots: ModelSlots
    optimizer: torch.optim.Optimizer | None
    sampler: Any  # None, or an object with state_dict()


@dataclass(slots=True)
class Saved:
    """What a state kind contributes to a save on one rank."""

    items: list[StreamItem] = field(default_factory=list)  # pieces for the rank's file
    records: list[PieceRecord] = field(default_factory=list)  # one per item, for the index
    files: list[tuple[str, bytes]] = field(default_factory=list)  # files of its own: name, bytes
    meta: dict[str, Any] = field(default_factory=dict)  # for the index header (rank 0's)

    def add(self, other: Saved) -> None:
        self.items += other.items
        self.records += other.records
        self.files += other.files
        self.meta.update(other.meta)


@dataclass(slots=True)
class LoadContext:
    """What every state kind's load reads: the checkpoint, its reader and the target."""

    root: str
    index: CheckpointIndex
    reader: CheckpointReader
    slots: ModelSlots
    optimizer: torch.optim.Optimizer | None
    sampler: Any  # None, or an object with load_state_dict()
    restore_rng: bool
    elsewhere: set[str]  # other pipeline stages' names
    matched: list[tuple[ParamSlot, str]]  # this rank's parameters and their saved names


@dataclass(frozen=True, slots=True)
class PlannedRead:
    """Elements ``[start, end)`` of a saved tensor that a rank copies."""

    name: str  # the saved name (``<parameter>/<state>`` for optimizer state)
    entry: TensorEntry
    start: int
    end: int


class KindLoad:
    """One state kind's part of one rank's load ([Note: a refused load changes nothing] in
    loading.py): every step a no-op unless the kind says otherwise."""

    def check(self, ctx: LoadContext) -> list[PlannedRead]:
        """Step 1: raise unless the copy would succeed; the ranges the copy will read."""
        return []

    def trial(self, ctx: LoadContext) -> None:
        """Once this rank's checks passed and its reads are verified: what may change on
        trial, before every rank agrees (put back by :meth:`undo`)."""

    def undo(self, ctx: LoadContext) -> None:
        """After a failed step 1 on any rank: put back what :meth:`check` set on trial."""

    def copy(self, ctx: LoadContext) -> None:
        """Step 2: copy the checked state in."""

    def finish(self, ctx: LoadContext) -> None:
        """Once every rank has copied: what must come last (the random streams)."""
