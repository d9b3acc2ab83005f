"""Index records of a checkpoint: where each tensor's pieces are, and each file's checksums.

[Note: piece runs]
Every rank of a sharded unit saves one piece of each parameter it overlaps, so a model of
P parameters on N ranks has up to P + N*units pieces; at 4,096 ranks a 7B model has about
400,000 of them. Listed one by one the index grows with the number of ranks and every
loading rank parses all of it. The pieces of a unit's parameter are regular, though:
world rank ``r`` holds the parameter's elements ``[base + r*step, base + (r+1)*step)``
clipped to the parameter, where ``step`` is the unit's shard size and ``base`` the
parameter's distance from the unit's flat buffer start. A :class:`PieceRun` records
those numbers once for a range of consecutive ranks; the loader computes just the pieces
that overlap what it reads. Pieces without that regularity (buffers, plain parameters,
scalars, ranks that are not consecutive) stay listed as :class:`PieceRef`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from ..base.dtypes import BY_NAME

MAX_ITEMSIZE = 8  # chunks hold whole elements of every supported dtype


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt, or does not fit the model."""


def dtype_check(name: str, where: str) -> None:
    if name not in BY_NAME:
        raise CheckpointError(f"{where}: unknown dtype {name!r} in the index")


def shard_file_name(save_id: str, world_rank: int) -> str:
    return f"{save_id}-rank{world_rank:05d}.safetensors"


@dataclass(frozen=True, slots=True)
class PieceRef:
    """Elements ``[start, end)`` of a flattened tensor, stored as ``key`` in ``file``."""

    file: str
    key: str
    start: int
    end: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, "start": self.start, "end": self.end}


@dataclass(frozen=True, slots=True)
class PieceRun:
    """One piece per world rank ``first_rank..last_rank`` (see [Note: piece runs]).

    Rank ``r``'s piece is elements ``[max(lo, base + r*step), min(hi, base + (r+1)*step))``
    of the flattened tensor, stored as ``key`` in ``shard_file_name(save_id, r)``.
    """

    first_rank: int
    last_rank: int
    key: str
    base: int
    step: int
    lo: int
    hi: int
    save_id: str = ""  # from the index's meta; not written per run

    def bounds(self, rank: int) -> tuple[int, int]:
        return max(self.lo, self.base + rank * self.step), min(
            self.hi, self.base + (rank + 1) * self.step
        )

    def check(self, name: str) -> None:
        """Every rank's piece non-empty and the pieces contiguous over ``[lo, hi)``."""
        first_start = self.base + self.first_rank * self.step
        last_end = self.base + (self.last_rank + 1) * self.step
        if not (
            self.step > 0
            and 0 <= self.first_rank <= self.last_rank
            and first_start <= self.lo < first_start + self.step
            and last_end - self.step < self.hi <= last_end
        ):
            raise CheckpointError(f"tensor {name!r}: piece run {self.to_json()} is inconsistent")

    def overlapping(self, start: int, end: int) -> list[PieceRef]:
        """The pieces of this run holding any element of ``[start, end)``."""
        lo, hi = max(start, self.lo), min(end, self.hi)
        if hi <= lo:
            return []
        first = max(self.first_rank, (lo - self.base) // self.step)
        last = min(self.last_rank, (hi - 1 - self.base) // self.step)
        return [
            PieceRef(shard_file_name(self.save_id, r), self.key, *self.bounds(r))
            for r in range(first, last + 1)
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "ranks": [self.first_rank, self.last_rank],
            "key": self.key,
            "base": self.base,
            "step": self.step,
            "span": [self.lo, self.hi],
        }

    @staticmethod
    def from_json(raw: Any, save_id: str) -> PieceRun:
        (first, last), (lo, hi) = raw["ranks"], raw["span"]
        values = (first, last, raw["base"], raw["step"], lo, hi)
        if not all(type(v) is int for v in values):
            raise TypeError(f"piece run {raw!r}: ranks, base, step and span must be integers")
        return PieceRun(first, last, str(raw["key"]), raw["base"], raw["step"], lo, hi, save_id)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One original tensor: global shape, dtype and the pieces that hold it."""

    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[PieceRef, ...]
    runs: tuple[PieceRun, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_pieces(self) -> int:
        return len(self.pieces) + sum(r.last_rank - r.first_rank + 1 for r in self.runs)

    def overlapping(self, start: int, end: int) -> list[PieceRef]:
        """Non-empty pieces holding any element of ``[start, end)``, in element order."""
        found = [p for p in self.pieces if min(end, p.end) > max(start, p.start)]
        for run in self.runs:
            found.extend(run.overlapping(start, end))
        return sorted(found, key=lambda p: p.start)

    def to_json(self) -> dict[str, Any]:
        raw: dict[str, Any] = {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "pieces": [p.to_json() for p in self.pieces],
        }
        if self.runs:
            raw["runs"] = [r.to_json() for r in self.runs]
        return raw

    @staticmethod
    def from_json(name: str, raw: Any, save_id: str = "") -> TensorEntry:
        try:
            shape = tuple(int(d) for d in raw["shape"])
            pieces = tuple(
                PieceRef(str(p["file"]), str(p["key"]), int(p["start"]), int(p["end"]))
                for p in raw["pieces"]
            )
            runs = tuple(PieceRun.from_json(r, save_id) for r in raw.get("runs", ()))
            entry = TensorEntry(shape, str(raw["dtype"]), pieces, runs)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"index entry {name!r} is malformed: {exc!r}") from exc
        dtype_check(entry.dtype, f"index entry {name!r}")
        check_coverage(name, entry)
        return entry


def check_coverage(name: str, entry: TensorEntry) -> None:
    """The pieces of ``entry`` must tile ``[0, numel)`` exactly once (empty pieces ignored)."""
    for run in entry.runs:
        run.check(name)
    spans = sorted(
        [(p.start, p.end) for p in entry.pieces if p.end != p.start]
        + [(r.lo, r.hi) for r in entry.runs]
    )
    position = 0
    for start, end in spans:
        if start != position or end < start:
            raise CheckpointError(
                f"tensor {name!r}: pieces do not tile [0, {entry.numel}) (gap or overlap at "
                f"element {position}, next piece [{start}, {end}))"
            )
        position = end
    if position != entry.numel:
        raise CheckpointError(
            f"tensor {name!r}: pieces cover {position} of its {entry.numel} elements"
        )


class SavedPiece(NamedTuple):
    """A piece as the saving rank reports it: ``step``/``origin`` describe its unit's shard
    (``step`` 0: a piece outside any run, such as a buffer). A tuple: rank 0 makes one
    per piece of the job, millions at tens of thousands of ranks."""

    rank: int
    file: str
    key: str
    start: int
    end: int
    step: int = 0
    origin: int = 0  # the parameter element where this rank's shard would start


def group_pieces(
    saved: list[SavedPiece], save_id: str
) -> tuple[tuple[PieceRef, ...], tuple[PieceRun, ...]]:
    """Fold regular pieces into runs ([Note: piece runs]); list the rest one by one."""
    listed: list[PieceRef] = []
    by_pattern: defaultdict[tuple[str, int, int], list[SavedPiece]] = defaultdict(list)
    for piece in saved:
        regular = piece.step > 0 and piece.file == shard_file_name(save_id, piece.rank)
        if regular:
            base = piece.origin - piece.rank * piece.step
            by_pattern[(piece.key, piece.step, base)].append(piece)
        else:
            listed.append(PieceRef(piece.file, piece.key, piece.start, piece.end))
    runs: list[PieceRun] = []
    for (key, step, base), pieces in by_pattern.items():
        pieces.sort(key=lambda p: p.rank)
        group: list[SavedPiece] = []
        for piece in pieces + [None]:  # type: ignore[list-item]
            if piece is not None and (not group or piece.rank == group[-1].rank + 1):
                group.append(piece)
                continue
            run = PieceRun(group[0].rank, group[-1].rank, key, base, step, 0, 0, save_id)
            run = replace(run, lo=group[0].start, hi=group[-1].end)
            if all(run.bounds(p.rank) == (p.start, p.end) for p in group) and len(group) > 1:
                runs.append(run)
            else:  # irregular after all, or a lone piece: list it
                listed.extend(PieceRef(p.file, key, p.start, p.end) for p in group)
            group = [piece] if piece is not None else []
    return tuple(sorted(listed, key=lambda p: p.start)), tuple(sorted(runs, key=lambda r: r.lo))


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One safetensors file of the checkpoint and its checksums.

    The file is hashed in chunks of ``chunk_bytes`` (format 2: ``chunks``, a list over
    the whole file; format 1: ``tensors``, each tensor apart, by key), so that a rank
    reading a range verifies only the chunks it reads; ``sha256`` covers the whole file
    (inspect).
    """

    size: int
    sha256: str
    chunk_bytes: int
    chunk_sha256: list[str] | dict[str, list[str]]  # file chunks, or (format 1) by key

    @property
    def num_chunks(self) -> int:
        chunks = self.chunk_sha256
        return sum(map(len, chunks.values())) if isinstance(chunks, dict) else len(chunks)

    def to_json(self) -> dict[str, Any]:
        name = "tensors" if isinstance(self.chunk_sha256, dict) else "chunks"
        return {
            "size": self.size,
            "sha256": self.sha256,
            "chunk_bytes": self.chunk_bytes,
            name: self.chunk_sha256,
        }

    @staticmethod
    def from_json(name: str, raw: Any) -> FileEntry:
        try:
            chunks: list[str] | dict[str, list[str]]
            if "chunks" in raw:
                if not isinstance(raw["chunks"], list):
                    raise TypeError("'chunks' must be a list")
                chunks = [str(d) for d in raw["chunks"]]
            else:
                chunks = {str(k): [str(d) for d in v] for k, v in raw["tensors"].items()}
            entry = FileEntry(int(raw["size"]), str(raw["sha256"]), int(raw["chunk_bytes"]), chunks)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"index entry for file {name!r} is malformed: {exc!r}") from exc
        if entry.chunk_bytes <= 0 or entry.chunk_bytes % MAX_ITEMSIZE:
            raise CheckpointError(
                f"index entry for file {name!r}: chunk_bytes {entry.chunk_bytes} is not a "
                f"positive multiple of {MAX_ITEMSIZE}"
            )
        return entry
