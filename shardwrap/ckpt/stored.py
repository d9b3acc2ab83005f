"""What a checkpoint's files hold, by their safetensors headers, against what the index says.

The reader asks this before it reads or allocates anything ([Note: checked before read]
in reader.py): whether a file is listed, inside the folder, present at its indexed size
with a checksum for each of its chunks, and whether a piece's key is stored in it with
the dtype and the number of elements the index gives. Only headers are read here.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from ..base.dtypes import SAFETENSORS_CODES
from .format import CheckpointError, CheckpointIndex, PieceRef, member_path

HEADER_LENGTH_BYTES = 8  # safetensors: a little-endian u64, then the JSON header


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor of a safetensors file, as its header describes it."""

    code: str  # safetensors dtype code ("F32", ...)
    shape: tuple[int, ...]
    begin: int  # first byte of its data in the file
    end: int  # one past its last byte


class StoredFiles:
    """The files of one checkpoint folder, each checked once, headers cached."""

    def __init__(self, root: str, index: CheckpointIndex) -> None:
        self.root = root
        self.index = index
        self._paths: dict[str, str] = {}  # file -> its checked path
        self._headers: dict[str, dict[str, StoredTensor]] = {}  # file -> key -> tensor

    def checked_path(self, file: str, where: str) -> str:
        """``root/file`` once it is listed, inside the folder, present at the index's size,
        and has a checksum for every chunk."""
        if file in self._paths:
            return self._paths[file]
        entry = self.index.files.get(file)
        if entry is None:
            raise CheckpointError(f"{where}: the file is not listed in the index's files")
        path = member_path(self.root, file)
        if not os.path.isfile(path):
            raise CheckpointError(f"{where}: the file is missing")
        size = os.path.getsize(path)
        if size != entry.size:
            raise CheckpointError(
                f"{where}: the file has {size} bytes, the index says {entry.size} "
                "(truncated or replaced)"
            )
        chunks = -(-size // entry.chunk_bytes)
        if isinstance(entry.chunk_sha256, list) and len(entry.chunk_sha256) != chunks:
            raise CheckpointError(
                f"{where}: the index lacks its checksums ({len(entry.chunk_sha256)} for the "
                f"file's {chunks} chunks)"
            )
        self._paths[file] = path
        return path

    def header(self, file: str, where: str) -> dict[str, StoredTensor]:
        """The tensors of ``file`` by key (the file checked first)."""
        if file not in self._headers:
            path = self.checked_path(file, where)
            self._headers[file] = _read_header(path, os.path.getsize(path), where)
        return self._headers[file]

    def check_piece(self, where: str, piece: PieceRef, dtype: torch.dtype) -> None:
        """``piece`` is stored under its key as ``end - start`` elements of ``dtype``."""
        stored = self.header(piece.file, where).get(piece.key)
        if stored is None:
            raise CheckpointError(f"{where}: the file holds no tensor {piece.key!r}")
        numel = piece.end - piece.start
        if stored.code != SAFETENSORS_CODES.get(dtype) or stored.shape != (numel,):
            raise CheckpointError(
                f"{where}: stored as {stored.code} {list(stored.shape)}, the index says "
                f"{dtype} [{numel}]"
            )
        if stored.end - stored.begin != numel * dtype.itemsize:
            raise CheckpointError(
                f"{where}: the header gives it {stored.end - stored.begin} bytes, not the "
                f"{numel * dtype.itemsize} of {numel} elements of {dtype}"
            )
        chunks = self.index.files[piece.file].chunk_sha256
        if isinstance(chunks, dict):  # format 1: each tensor's chunks apart
            per_chunk = self.index.files[piece.file].chunk_bytes // dtype.itemsize
            digests = chunks.get(piece.key)
            if digests is None or len(digests) != -(-numel // per_chunk):
                raise CheckpointError(f"{where}: the index lacks its checksums")

    def data_offset(self, file: str, key: str) -> int:
        """Where tensor ``key``'s bytes start in ``file`` (checked before)."""
        return self._headers[file][key].begin

    def keys_in(self, file: str, start: int, end: int) -> str:
        """Which tensors bytes ``[start, end)`` of ``file`` hold, for an error message."""
        tensors = sorted(self._headers.get(file, {}).items(), key=lambda item: item[1].begin)
        keys = [k for k, t in tensors if t.begin < end and t.end > start]
        if not keys:
            return "its header"
        shown = ", ".join(repr(k) for k in keys[:8])
        return f"which hold {shown}" + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def _read_header(path: str, size: int, where: str) -> dict[str, StoredTensor]:
    """Parse a safetensors header; every tensor's bytes must lie inside the file."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(HEADER_LENGTH_BYTES))
            if length > size - HEADER_LENGTH_BYTES:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
        start = HEADER_LENGTH_BYTES + length
        tensors = {}
        for key, raw in header.items():
            if key == "__metadata__":
                continue
            first, last = (int(v) for v in raw["data_offsets"])
            tensors[key] = StoredTensor(
                str(raw["dtype"]), tuple(int(d) for d in raw["shape"]), start + first, start + last
            )
            if not start <= tensors[key].begin <= tensors[key].end <= size:
                raise ValueError(f"tensor {key!r} lies outside the file's {size} bytes")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
        raise CheckpointError(f"{where}: unreadable safetensors header ({exc})") from exc
    return tensors
