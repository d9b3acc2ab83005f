"""Reading element ranges of checkpoint tensors, with checksum verification.

A rank asks for elements ``[start, end)`` of one original tensor; the reader opens (memory
maps) only the files whose pieces overlap that range and reads only those pieces. Every
piece is checked against its file's header and its sha256 from the index before any of
its data is used ([Note: checked before read]), so a flipped byte, a truncated file or a
piece the index declares larger than stored is reported with the file and the tensor it
hit.
"""

from __future__ import annotations

import hashlib
import os
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
from .stored import StoredFiles


class CheckpointReader:
    """Verified, range-restricted reads from one checkpoint folder.

    [Note: checked before read]
    What a read can find wrong (a file not listed in the index, outside the folder, missing
    or of another size, missing checksums, a key the file lacks or stores with another
    dtype or length) is found by :meth:`check_pieces` from the index and the files'
    headers alone, before anything is read or allocated: a tensor the index declares
    larger than its pieces are stored cannot make a reader allocate it. :meth:`verify_range`
    adds the checksums of the chunks a range lies in, without copying the data out, so
    ``load_checkpoint`` runs it over everything a rank will read before the first tensor
    is copied, then :meth:`seal` s the reader: a later read that needs a check not made
    yet is a bug in the loader's plan, and raises instead of changing part of a model.
    """

    def __init__(self, root: str, index: CheckpointIndex, *, keep_files_open: bool = True) -> None:
        self.root = root
        self.index = index
        # Open files stay memory-mapped, and their touched pages count as resident; a
        # streaming reader (consolidation) drops each file after each piece instead.
        self.keep_files_open = keep_files_open
        self._open: dict[str, Any] = {}  # file name -> safe_open handle
        self._verified: set[tuple[str, str, int]] = set()  # (file, key or "", chunk) checked
        self._files = StoredFiles(root, index)
        self._checked: set[tuple[str, str, int, torch.dtype]] = set()  # pieces checked
        self._sealed = False

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def seal(self) -> None:
        """From now on a read needing a check not made yet raises ([Note: checked before
        read])."""
        self._sealed = True

    def check_pieces(
        self, name: str, entry: TensorEntry, start: int = 0, end: int | None = None
    ) -> list[PieceRef]:
        """The pieces holding elements ``[start, end)`` of tensor ``name`` (all of it by
        default), each checked against its file ([Note: checked before read])."""
        end = entry.numel if end is None else end
        if not 0 <= start <= end <= entry.numel:
            raise CheckpointError(
                f"tensor {name!r}: range [{start}, {end}) outside its {entry.numel} elements"
            )
        dtype = dtype_from_name(entry.dtype, f"tensor {name!r}")
        pieces = entry.overlapping(start, end)
        for piece in pieces:
            if (piece.file, piece.key, piece.end - piece.start, dtype) not in self._checked:
                self._check_unsealed(self._where(name, piece))
                self._files.check_piece(self._where(name, piece), piece, dtype)
                self._checked.add((piece.file, piece.key, piece.end - piece.start, dtype))
        return pieces

    def verify_range(self, name: str, entry: TensorEntry, start: int, end: int) -> None:
        """Every check :meth:`read_range` makes, chunk checksums included, without keeping
        the data ([Note: checked before read])."""
        dtype = dtype_from_name(entry.dtype, f"tensor {name!r}")
        for piece in self.check_pieces(name, entry, start, end):
            first, last = max(start, piece.start), min(end, piece.end)
            self._verify_piece(name, piece, first - piece.start, last - piece.start, dtype)

    def read_range(self, name: str, entry: TensorEntry, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``name`` flattened (1-D, the stored dtype)."""
        overlapping = self.check_pieces(name, entry, start, end)
        dtype = dtype_from_name(entry.dtype, f"tensor {name!r}")
        if len(overlapping) == 1:  # the common case: no extra copy
            piece = overlapping[0]
            return self._piece_range(name, piece, start - piece.start, end - piece.start, dtype)
        out = torch.empty(end - start, dtype=dtype)  # the pieces are stored: it fits in them
        for piece in overlapping:
            lo, hi = max(start, piece.start), min(end, piece.end)
            data = self._piece_range(name, piece, lo - piece.start, hi - piece.start, dtype)
            out[lo - start : hi - start].copy_(data)
        return out

    def read_full(self, name: str, entry: TensorEntry) -> torch.Tensor:
        return self.read_range(name, entry, 0, entry.numel).view(entry.shape)

    def _where(self, name: str, piece: PieceRef) -> str:
        return f"checkpoint {self.root}: file {piece.file!r}, tensor {name!r} (key {piece.key!r})"

    def _check_unsealed(self, where: str) -> None:
        if self._sealed:
            raise RuntimeError(
                f"{where}: read without the check load_checkpoint makes before it copies "
                "anything (its plan of reads missed this one; a shardwrap bug)"
            )

    def _piece_range(
        self, name: str, piece: PieceRef, first: int, last: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Elements ``[first, last)`` of a stored piece, verifying the chunks that hold them."""
        where = self._where(name, piece)
        if isinstance(self.index.files[piece.file].chunk_sha256, dict):  # format 1
            return self._piece_range_v1(where, piece, first, last, piece.end - piece.start, dtype)
        data = self._read_slice(where, piece, first, last, piece.end - piece.start, dtype)
        self._verify_piece(name, piece, first, last, dtype)
        return data

    def _verify_piece(self, name: str, piece: PieceRef, first: int, last: int, dtype) -> None:
        """Check the chunks that hold elements ``[first, last)`` of a stored piece."""
        where = self._where(name, piece)
        if isinstance(self.index.files[piece.file].chunk_sha256, dict):  # format 1
            # its chunks are of the tensor's bytes: read them to hash them
            self._piece_range_v1(where, piece, first, last, piece.end - piece.start, dtype)
            return
        start = self._files.data_offset(piece.file, piece.key) + first * dtype.itemsize
        self._verify_file_bytes(where, piece.file, start, last - first, dtype.itemsize)

    def _verify_file_bytes(self, where: str, file: str, start: int, count: int, itemsize: int):
        """Check the file's chunks that hold ``count`` elements from byte ``start``."""
        entry = self.index.files[file]
        size, digests = entry.chunk_bytes, entry.chunk_sha256
        chunks = range(start // size, -(-(start + count * itemsize) // size))
        todo = [c for c in chunks if (file, "", c) not in self._verified]
        if not todo:
            return
        self._check_unsealed(where)
        if todo[-1] >= len(digests):
            raise CheckpointError(f"{where}: the index lacks its checksums")
        with open(self._files.checked_path(file, where), "rb") as handle:
            for chunk in todo:
                handle.seek(chunk * size)
                if hashlib.sha256(handle.read(size)).hexdigest() != digests[chunk]:
                    held = self._files.keys_in(file, chunk * size, (chunk + 1) * size)
                    raise CheckpointError(
                        f"{where}: checksum mismatch in bytes {chunk * size}..{(chunk + 1) * size} "
                        f"of the file, {held} (the file is corrupt)"
                    )
                self._verified.add((file, "", chunk))

    def _piece_range_v1(self, where: str, piece: PieceRef, first: int, last: int, numel, dtype):
        """Format 1: each tensor hashed apart; read and verify whole chunks of the tensor."""
        file_entry = self.index.files[piece.file]
        digests = file_entry.chunk_sha256[piece.key]  # type: ignore[index]  # checked
        per_chunk = file_entry.chunk_bytes // dtype.itemsize
        first_chunk, end_chunk = first // per_chunk, -(-last // per_chunk)
        lo, hi = first_chunk * per_chunk, min(numel, end_chunk * per_chunk)
        data = self._read_slice(where, piece, lo, hi, numel, dtype)
        raw = tensor_bytes(data)
        for chunk in range(first_chunk, end_chunk):
            if (piece.file, piece.key, chunk) in self._verified:
                continue
            self._check_unsealed(where)
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
        path = self._files.checked_path(file, where)
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
