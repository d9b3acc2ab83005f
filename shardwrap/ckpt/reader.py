"""Reading element ranges of checkpoint tensors, with checksum verification.

A rank asks for elements ``[start, end)`` of one original tensor; the reader opens (memory
maps) only the files whose pieces overlap that range and reads only those pieces. Every
piece is checked against its sha256 from the index before any of its data is used, so a
flipped byte or a truncated file is reported with the file and the tensor it hit.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any

import torch
from safetensors import safe_open

from .format import (
    CheckpointError,
    CheckpointIndex,
    PieceRef,
    TensorEntry,
    dtype_from_name,
    member_path,
    tensor_bytes,
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
        self._verified: set[tuple[str, str, int]] = set()  # (file, key or "", chunk) checked
        self._offsets: dict[str, dict[str, int]] = {}  # file -> key -> first byte

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
        overlapping = entry.overlapping(start, end)
        if len(overlapping) == 1:  # the common case: no extra copy
            piece = overlapping[0]
            return self._piece_range(name, piece, start - piece.start, end - piece.start, dtype)
        out = torch.empty(end - start, dtype=dtype)
        for piece in overlapping:
            lo, hi = max(start, piece.start), min(end, piece.end)
            data = self._piece_range(name, piece, lo - piece.start, hi - piece.start, dtype)
            out[lo - start : hi - start].copy_(data)
        return out

    def read_full(self, name: str, entry: TensorEntry) -> torch.Tensor:
        return self.read_range(name, entry, 0, entry.numel).view(entry.shape)

    def _piece_range(
        self, name: str, piece: PieceRef, first: int, last: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Elements ``[first, last)`` of a stored piece, verifying the chunks that hold them."""
        where = f"checkpoint {self.root}: file {piece.file!r}, tensor {name!r} (key {piece.key!r})"
        file_entry = self.index.files[piece.file]
        numel = piece.end - piece.start
        if isinstance(file_entry.chunk_sha256, dict):  # format 1: chunks of each tensor
            return self._piece_range_v1(where, piece, first, last, numel, dtype)
        data = self._read_slice(where, piece, first, last, numel, dtype)
        offset = self._data_offset(piece.file, piece.key, where)
        itemsize = data.element_size()
        self._verify_file_bytes(
            where, piece.file, offset + first * itemsize, last - first, itemsize
        )
        return data

    def _verify_file_bytes(self, where: str, file: str, start: int, count: int, itemsize: int):
        """Check the file's chunks that hold ``count`` elements from byte ``start``."""
        entry = self.index.files[file]
        size, digests = entry.chunk_bytes, entry.chunk_sha256
        chunks = range(start // size, -(-(start + count * itemsize) // size))
        todo = [c for c in chunks if (file, "", c) not in self._verified]
        if not todo:
            return
        if todo[-1] >= len(digests):
            raise CheckpointError(f"{where}: the index lacks its checksums")
        with open(member_path(self.root, file), "rb") as handle:
            for chunk in todo:
                handle.seek(chunk * size)
                if hashlib.sha256(handle.read(size)).hexdigest() != digests[chunk]:
                    raise CheckpointError(
                        f"{where}: checksum mismatch in bytes {chunk * size}..{(chunk + 1) * size} "
                        f"of the file, {self._keys_in(file, chunk * size, (chunk + 1) * size)} "
                        "(the file is corrupt)"
                    )
                self._verified.add((file, "", chunk))

    def _keys_in(self, file: str, start: int, end: int) -> str:
        """Which tensors bytes ``[start, end)`` of ``file`` hold, for an error message."""
        offsets = sorted(self._offsets.get(file, {}).items(), key=lambda item: item[1])
        ends = [at for _, at in offsets[1:]] + [end]
        keys = [k for (k, at), stop in zip(offsets, ends, strict=True) if at < end and stop > start]
        if not keys:
            return "its header"
        shown = ", ".join(repr(k) for k in keys[:8])
        return f"which hold {shown}" + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")

    def _data_offset(self, file: str, key: str, where: str) -> int:
        """Where tensor ``key``'s bytes start in ``file`` (from its safetensors header)."""
        if file not in self._offsets:
            path = member_path(self.root, file)
            try:
                with open(path, "rb") as handle:
                    (length,) = struct.unpack("<Q", handle.read(8))
                    header = json.loads(handle.read(length))
                self._offsets[file] = {
                    k: 8 + length + int(v["data_offsets"][0])
                    for k, v in header.items()
                    if k != "__metadata__"
                }
            except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
                raise CheckpointError(f"{where}: unreadable safetensors header ({exc})") from exc
        if key not in self._offsets[file]:
            raise CheckpointError(f"{where}: the file holds no tensor {key!r}")
        return self._offsets[file][key]

    def _piece_range_v1(self, where: str, piece: PieceRef, first: int, last: int, numel, dtype):
        """Format 1: each tensor hashed apart; read and verify whole chunks of the tensor."""
        file_entry = self.index.files[piece.file]
        digests = file_entry.chunk_sha256.get(piece.key)  # type: ignore[union-attr]
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_chunk = file_entry.chunk_bytes // itemsize
        if digests is None or len(digests) != -(-numel // per_chunk):
            raise CheckpointError(f"{where}: the index lacks its checksums")
        first_chunk, end_chunk = first // per_chunk, -(-last // per_chunk)
        lo, hi = first_chunk * per_chunk, min(numel, end_chunk * per_chunk)
        data = self._read_slice(where, piece, lo, hi, numel, dtype)
        raw = tensor_bytes(data)
        for chunk in range(first_chunk, end_chunk):
            if (piece.file, piece.key, chunk) in self._verified:
                continue
            size = file_entry.chunk_bytes
            offset = (chunk - first_chunk) * size
            actual = hashlib.sha256(raw[offset : offset + size]).hexdigest()
            if actual != digests[chunk]:
                raise CheckpointError(
                    f"{where}: checksum mismatch in bytes {chunk * size}..{(chunk + 1) * size} "
                    "of the tensor (the file is corrupt)"
                )
            self._verified.add((piece.file, piece.key, chunk))
        return data[first - lo : last - lo]

    def _read_slice(self, where: str, piece: PieceRef, lo: int, hi: int, numel: int, dtype):
        handle = self._handle(piece.file, where)
        try:
            view = handle.get_slice(piece.key)
            shape = list(view.get_shape())
            data = view[lo:hi] if shape == [numel] else None
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{where}: cannot be read ({exc})") from exc
        if data is None or data.dtype != dtype:
            stored = data.dtype if data is not None else view.get_dtype()
            raise CheckpointError(
                f"{where}: stored as {stored} {shape}, the index says {dtype} [{numel}]"
            )
        return data

    def _handle(self, file: str, where: str):
        if file in self._open:
            return self._open[file]
        path = member_path(self.root, file)
        expected = self.index.files[file]
        if not os.path.exists(path):
            raise CheckpointError(f"{where}: the file is missing")
        size = os.path.getsize(path)
        if size != expected.size:
            raise CheckpointError(
                f"{where}: the file has {size} bytes, the index says {expected.size} "
                "(truncated or replaced)"
            )
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as exc:
            raise CheckpointError(f"{where}: not a readable safetensors file ({exc})") from exc
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
