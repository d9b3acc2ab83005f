"""On-disk format of a sharded checkpoint: the JSON index, checksums, safe file writes.

[Note: checkpoint layout]
A checkpoint is a folder::

    index.json                          written last, by world rank 0: the commit point
    <save_id>-rank00000.safetensors     what world rank 0 wrote (model, optimizer, buffers)
    <save_id>-rank00001.safetensors     ...

Every saved tensor is a 1-D *piece*: the element range ``[start, end)`` of one original
tensor, flattened. The index maps each original name to its global shape, dtype and the
pieces (file, key, range) that cover it exactly once. Each file's entry carries its size,
the sha256 of its bytes and the sha256 of every fixed-size chunk of every tensor in it (a
loading rank verifies just the chunks it reads). Nothing is pickled.

A save writes every file under a temporary name, fsyncs it and renames it; only once all
ranks' files are durable does rank 0 write the index the same way. A folder whose index
is missing is an unfinished save. Files of an older save stay untouched (their names carry
another save id) until a newer index replaces the old one.

This module is pure file handling: no process group, so it is unit-tested directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..base.dtypes import BY_NAME
from ..base.validate import unique_keys
from .entries import (
    MAX_ITEMSIZE,
    CheckpointError,
    FileEntry,
    PieceRef,
    PieceRun,
    TensorEntry,
    check_coverage,
    shard_file_name,
)

__all__ = [
    "MAX_ITEMSIZE",
    "CheckpointError",
    "FileEntry",
    "PieceRef",
    "PieceRun",
    "TensorEntry",
    "check_coverage",
    "shard_file_name",
]

INDEX_NAME = "index.json"
FORMAT_NAME = "shardwrap-checkpoint"
FORMAT_VERSION = 2  # 2: piece runs ([Note: piece runs] in entries.py); 1 still loads
READABLE_VERSIONS = (1, 2)
META_KEYS = ("save_id", "world_size", "num_shards", "strategy", "optimizer_class", "run_state")
SHARD_FILE_PATTERN = re.compile(r"^[0-9a-f]{16}-rank\d{5}\.safetensors$")
RUN_FILE_PATTERN = re.compile(r"^[0-9a-f]{16}-rank\d{5}\.run\.json$")  # ckpt/run_state.py
TEMP_SUFFIX = ".tmp"
DEFAULT_CHUNK_BYTES = 1 << 22  # 4 MiB: the unit of checksum verification on load


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in BY_NAME:
        raise TypeError(f"dtype {dtype} cannot be stored in a checkpoint")
    return name


def dtype_from_name(name: str, where: str) -> torch.dtype:
    if name not in BY_NAME:
        raise CheckpointError(f"{where}: unknown dtype {name!r} in the index")
    return BY_NAME[name]


class ChunkHasher:
    """sha256 of each ``chunk_bytes``-sized chunk of a byte stream fed in any pieces.

    Format 2 hashes each file in chunks from its first byte (header included), whatever
    the tensors in it: a file of B bytes has ``ceil(B / chunk_bytes)`` digests, however
    many pieces it holds. (Format 1 hashed each tensor apart: one digest at least per
    piece, which made the index grow with the number of ranks.)
    """

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.digests: list[str] = []
        self._current = hashlib.sha256()
        self._filled = 0

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        position = 0
        while position < len(view):
            take = min(self.chunk_bytes - self._filled, len(view) - position)
            self._current.update(view[position : position + take])
            self._filled += take
            position += take
            if self._filled == self.chunk_bytes:
                self._close_chunk()

    def finish(self) -> list[str]:
        if self._filled:
            self._close_chunk()
        return self.digests

    def _close_chunk(self) -> None:
        self.digests.append(self._current.hexdigest())
        self._current = hashlib.sha256()
        self._filled = 0


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes (row-major, native little-endian), without a copy when contiguous."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


# ------------------------------------------------------------------------ paths
def check_plain_name(root: str, name: str) -> None:
    """Refuse a file name that is not a plain name (the lexical half of :func:`member_path`,
    cheap enough to run over every file of the index when it is read)."""
    if (
        not isinstance(name, str)
        or not name
        or os.path.isabs(name)
        or name != os.path.basename(name)
        or name in (".", "..")
        or "\\" in name
        or "\x00" in name
    ):
        raise CheckpointError(
            f"checkpoint {root}: the index names file {name!r}, which is not a plain file "
            "name inside the checkpoint folder (path traversal refused)"
        )


def member_path(root: str, name: str) -> str:
    """``root/name`` for a file named in the index; refuses names that leave ``root``
    (lexically, or through a symlink: checked when the file is opened)."""
    check_plain_name(root, name)
    full = os.path.realpath(os.path.join(root, name))
    if os.path.dirname(full) != os.path.realpath(root):
        raise CheckpointError(
            f"checkpoint {root}: file {name!r} resolves to {full}, outside the checkpoint folder"
        )
    return full


# ---------------------------------------------------------------- durable writes
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(folder: str, name: str, data: bytes | memoryview) -> None:
    """Write ``folder/name`` so that it exists complete or not at all."""
    temp = os.path.join(folder, f".{name}{TEMP_SUFFIX}")
    try:
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, os.path.join(folder, name))
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
        raise OSError(exc.errno, f"writing {os.path.join(folder, name)}: {exc.strerror}") from exc
    fsync_dir(folder)


def remove_stale_files(folder: str, keep: set[str], save_id: str | None = None) -> list[str]:
    """Delete shard files, run files not of ``save_id`` and temporaries; returns their names."""
    removed = []
    for name in os.listdir(folder):
        stale_shard = SHARD_FILE_PATTERN.match(name) and name not in keep
        stale_run = RUN_FILE_PATTERN.match(name) and not name.startswith(f"{save_id}-")
        temporary = name.startswith(".") and name.endswith(TEMP_SUFFIX)
        if stale_shard or stale_run or temporary:
            os.remove(os.path.join(folder, name))
            removed.append(name)
    return removed


# ------------------------------------------------------------------------ index
@dataclass(frozen=True)
class CheckpointIndex:
    """The parsed ``index.json``."""

    meta: dict[str, Any]  # world_size, strategy, save_id, ...
    params: dict[str, TensorEntry]  # canonical parameter name -> entry
    aliases: dict[str, str]  # tied parameter name -> canonical name
    buffers: dict[str, TensorEntry]
    optim_state: dict[str, dict[str, Any]] | None  # param -> state name -> entry or value
    param_groups: list[dict[str, Any]] | None  # hyperparameters + "params": [names]
    files: dict[str, FileEntry]
    extra: Any

    def to_json(self) -> dict[str, Any]:
        optim = None
        if self.optim_state is not None:
            optim = {
                "state": {
                    name: {k: _state_to_json(v) for k, v in states.items()}
                    for name, states in self.optim_state.items()
                },
                "param_groups": self.param_groups,
            }
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            **self.meta,
            "params": {k: v.to_json() for k, v in self.params.items()},
            "aliases": self.aliases,
            "buffers": {k: v.to_json() for k, v in self.buffers.items()},
            "optimizer": optim,
            "files": {k: v.to_json() for k, v in self.files.items()},
            "extra": self.extra,
        }

    def resolve(self, name: str) -> str:
        return self.aliases.get(name, name)


def _state_to_json(value: TensorEntry | dict[str, Any]) -> dict[str, Any]:
    return value.to_json() if isinstance(value, TensorEntry) else value


def _state_from_json(name: str, raw: Any, save_id: str) -> TensorEntry | dict[str, Any]:
    if isinstance(raw, dict) and "value" in raw and len(raw) == 1:
        return raw
    return TensorEntry.from_json(name, raw, save_id)


def parse_index(root: str, raw: Any) -> CheckpointIndex:
    """Validate the JSON of an index (format, entries, file names) and parse it."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise CheckpointError(f"checkpoint {root}: {INDEX_NAME} is not a shardwrap index")
    if raw.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint {root}: format version {raw.get('version')!r}, this shardwrap reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    save_id = raw.get("save_id", "")
    if not isinstance(save_id, str):
        raise _bad(root, f"'save_id' must be a string, not a {type(save_id).__name__}")
    files = {n: FileEntry.from_json(n, v) for n, v in _mapping(root, raw, "files").items()}
    for name in files:
        check_plain_name(root, name)

    def entries(key: str) -> dict[str, TensorEntry]:
        return {
            k: TensorEntry.from_json(k, v, save_id) for k, v in _mapping(root, raw, key).items()
        }

    params, buffers = entries("params"), entries("buffers")
    optim_state, param_groups = _parse_optimizer(root, raw.get("optimizer"), save_id)
    _check_files_named(root, files, save_id, _all_entries(params, buffers, optim_state))
    meta = {k: raw[k] for k in META_KEYS if k in raw}
    aliases = _mapping(root, raw, "aliases")
    if not all(isinstance(v, str) for v in aliases.values()):
        raise _bad(root, "'aliases' must map names to names")
    return CheckpointIndex(
        meta, params, aliases, buffers, optim_state, param_groups, files, raw.get("extra")
    )


def _check_files_named(root: str, files: dict, save_id: str, all_entries) -> None:
    """Every piece, listed or in a run, must name a file of the index."""
    # The usual case: the files are exactly ranks 0..n-1, so a run whose first and last
    # ranks have files has them all.
    contiguous = all(shard_file_name(save_id, r) in files for r in range(len(files)))
    for entry in all_entries:
        for piece in entry.pieces:
            if piece.file not in files:
                member_path(root, piece.file)
                raise CheckpointError(
                    f"checkpoint {root}: a piece names file {piece.file!r}, absent from the index"
                )
        for run in entry.runs:
            missing = [
                r
                for r in (run.first_rank, run.last_rank)
                if shard_file_name(save_id, r) not in files
            ]
            if missing or not contiguous:  # not contiguous: check each rank (rare, slow)
                missing += [
                    r
                    for r in range(run.first_rank, run.last_rank + 1)
                    if shard_file_name(save_id, r) not in files
                ]
            if missing:
                raise CheckpointError(
                    f"checkpoint {root}: a piece run of key {run.key!r} names file "
                    f"{shard_file_name(save_id, missing[0])!r}, absent from the index"
                )


def _bad(root: str, text: str) -> CheckpointError:
    return CheckpointError(f"checkpoint index {os.path.join(root, INDEX_NAME)}: {text}")


def _mapping(root: str, raw: dict, key: str, what: str | None = None) -> dict[str, Any]:
    """``raw[key]`` (empty when absent), which the format says is a JSON object."""
    value = raw.get(key, {})
    if not isinstance(value, dict):
        kind = type(value).__name__
        raise _bad(root, f"{what or repr(key)} must be a JSON object, not a {kind}")
    return dict(value)


def _parse_optimizer(root: str, optim: Any, save_id: str):
    """``optimizer``: ``{"state": {param: {state: entry}}, "param_groups": [{...}]}``."""
    if optim is None:
        return None, None
    if not isinstance(optim, dict) or "state" not in optim or "param_groups" not in optim:
        raise _bad(root, "'optimizer' must be an object with 'state' and 'param_groups'")
    optim_state = {}
    for name in _mapping(root, optim, "state", "'optimizer.state'"):
        states = _mapping(root, optim["state"], name, f"'optimizer.state.{name}'")
        optim_state[name] = {
            k: _state_from_json(f"{name}/{k}", v, save_id) for k, v in states.items()
        }
    groups = optim["param_groups"]
    if not isinstance(groups, list):
        kind = type(groups).__name__
        raise _bad(root, f"'optimizer.param_groups' must be a JSON list, not a {kind}")
    for i, group in enumerate(groups):
        names = group.get("params") if isinstance(group, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _bad(root, f"'optimizer.param_groups[{i}]' must be an object with 'params'")
    return optim_state, list(groups)


def _all_entries(params, buffers, optim_state):
    yield from params.values()
    yield from buffers.values()
    for states in (optim_state or {}).values():
        yield from (v for v in states.values() if isinstance(v, TensorEntry))


def read_index(root: str) -> CheckpointIndex:
    """Read ``root/index.json``; a folder of shard files without one is an unfinished save."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"checkpoint {root}: no such folder")
    index_path = os.path.join(root, INDEX_NAME)
    if not os.path.exists(index_path):
        shards = [n for n in os.listdir(root) if SHARD_FILE_PATTERN.match(n)]
        temporaries = [n for n in os.listdir(root) if n.endswith(TEMP_SUFFIX)]
        if shards or temporaries:
            raise CheckpointError(
                f"checkpoint {root} is incomplete: {len(shards)} shard file(s) and "
                f"{len(temporaries)} temporary file(s) but no {INDEX_NAME}; the save did not "
                "finish (a rank failed or was killed). Load an earlier checkpoint."
            )
        raise CheckpointError(f"checkpoint {root}: no {INDEX_NAME} (not a shardwrap checkpoint)")
    with open(index_path, encoding="utf-8") as handle:
        try:
            raw = json.load(handle, object_pairs_hook=unique_keys(index_path, CheckpointError))
        except json.JSONDecodeError as exc:
            raise CheckpointError(
                f"checkpoint {root}: {INDEX_NAME} is not valid JSON: {exc}"
            ) from exc
    return parse_index(root, raw)


def index_bytes(index: CheckpointIndex) -> bytes:
    """The index as JSON, one top-level key per line (compact inside: it can be large)."""
    raw = index.to_json()
    lines = [f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in raw.items()]
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode("utf-8")
