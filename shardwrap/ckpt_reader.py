"""Reading element ranges of checkpoint tensors, with checksum verification.

A rank asks for elements ``[start, end)`` of one original tensor; the reader opens (memory
maps) only the files whose pieces overlap that range and reads only those pieces. Every
piece is checked against its sha256 from the index before any of its data is used, so a
flipped byte or a truncated file is reported with the file and the tensor it hit.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from safetensors import safe_open

from .ckpt_format import (
    CheckpointError,
    CheckpointIndex,
    TensorEntry,
    dtype_from_name,
    member_path,
    tensor_sha256,
)


class CheckpointReader:
    """Verified, range-restricted reads from one checkpoint folder."""

    def __init__(self, root: str, index: CheckpointIndex, *, keep_files_open: bool = True) -> None:
        self.root = root
        self.index = index
        # Open files stay memory-mapped, and their touched pages count as resident; a
        # streaming reader (consolidation) drops each file after each piece instead.
        self.keep_files_open = keep_files_open
        self._open: dict[str, Any] = {}  # file name -> safe_open handle
        self._verified: set[tuple[str, str]] = set()  # (file, key) whose checksum matched

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_range(self, name: str, entry: TensorEntry, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``name`` flattened (1-D, the stored dtype)."""
        if not 0 <= start <= end <= entry.numel:
            raise CheckpointError(
                f"tensor {name!r}: range [{start}, {end}) outside its {entry.numel} elements"
            )
        dtype = dtype_from_name(entry.dtype, f"tensor {name!r}")
        out = torch.empty(end - start, dtype=dtype)
        for piece in entry.pieces:
            lo, hi = max(start, piece.start), min(end, piece.end)
            if hi <= lo:
                continue
            data = self._piece(name, piece.file, piece.key, piece.end - piece.start, dtype)
            out[lo - start : hi - start].copy_(data[lo - piece.start : hi - piece.start])
        return out

    def read_full(self, name: str, entry: TensorEntry) -> torch.Tensor:
        return self.read_range(name, entry, 0, entry.numel).view(entry.shape)

    def _piece(
        self, name: str, file: str, key: str, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        handle = self._handle(file, name)
        where = f"checkpoint {self.root}: file {file!r}, tensor {name!r} (key {key!r})"
        try:
            data = handle.get_tensor(key)
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{where}: cannot be read ({exc})") from exc
        if data.dtype != dtype or data.dim() != 1 or data.numel() != numel:
            raise CheckpointError(
                f"{where}: stored as {data.dtype} {tuple(data.shape)}, the index says "
                f"{dtype} ({numel},)"
            )
        if (file, key) not in self._verified:
            expected = self.index.files[file].tensor_sha256.get(key)
            if expected is None:
                raise CheckpointError(f"{where}: no checksum in the index")
            if tensor_sha256(data) != expected:
                raise CheckpointError(f"{where}: checksum mismatch (the file is corrupt)")
            self._verified.add((file, key))
        return data

    def _handle(self, file: str, name: str):
        if file in self._open:
            return self._open[file]
        path = member_path(self.root, file)
        expected = self.index.files[file]
        if not os.path.exists(path):
            raise CheckpointError(
                f"checkpoint {self.root}: file {file!r} (holding tensor {name!r}) is missing"
            )
        size = os.path.getsize(path)
        if size != expected.size:
            raise CheckpointError(
                f"checkpoint {self.root}: file {file!r} (holding tensor {name!r}) has {size} "
                f"bytes, the index says {expected.size} (truncated or replaced)"
            )
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {self.root}: file {file!r} (holding tensor {name!r}) is not a "
                f"readable safetensors file ({exc})"
            ) from exc
        if self.keep_files_open:
            self._open[file] = handle
        return handle


def file_sha256(path: str, chunk_bytes: int = 1 << 24) -> str:
    """sha256 of a whole file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def verify_files(root: str, index: CheckpointIndex) -> dict[str, str]:
    """Status of every file named in the index: ``ok``, ``missing``, ``size mismatch``, ..."""
    status = {}
    for name, entry in index.files.items():
        path = member_path(root, name)
        if not os.path.exists(path):
            status[name] = "missing"
        elif os.path.getsize(path) != entry.size:
            status[name] = f"size mismatch ({os.path.getsize(path)} != {entry.size} bytes)"
        elif file_sha256(path) != entry.sha256:
            status[name] = "checksum mismatch"
        else:
            status[name] = "ok"
    return status
