"""Writing safetensors files one tensor at a time.

``safetensors.torch.save`` needs every tensor in memory at once and refuses tensors that
share storage (our pieces are views of one flat shard). The format is simple enough to
stream: an 8-byte little-endian header length, a JSON header with each tensor's dtype,
shape and byte range, then the raw little-endian bytes in header order. We compute the
header from shapes alone, then write each tensor as it is produced, hashing on the way, so
peak memory is one tensor (a tensor in a mapped file, ``DiskOffload``'s, is released
from the process once written).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..base.dtypes import SAFETENSORS_CODES
from ..base.pages import release_resident
from .format import DEFAULT_CHUNK_BYTES, TEMP_SUFFIX, ChunkHasher, fsync_dir, tensor_bytes

_ALIGN = 8


@dataclass(frozen=True)
class StreamItem:
    """One tensor to write: its key, dtype and shape now, its data when ``produce`` runs."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class WrittenFile:
    size: int
    sha256: str
    chunk_bytes: int
    chunk_sha256: list[str]  # digests of the file's chunks (see ChunkHasher)


def header_bytes(items: list[StreamItem], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for item in items:
        if item.dtype not in SAFETENSORS_CODES:
            raise TypeError(f"tensor {item.key!r}: dtype {item.dtype} cannot go into safetensors")
        header[item.key] = {
            "dtype": SAFETENSORS_CODES[item.dtype],
            "shape": list(item.shape),
            "data_offsets": [offset, offset + item.num_bytes],
        }
        offset += item.num_bytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def write_stream(
    path: str,
    items: list[StreamItem],
    metadata: dict[str, str] | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> WrittenFile:
    """Write ``items`` to ``path`` under a temporary name, fsync, rename into place.

    A failure (a full disk, say) removes the temporary and names the file being written.
    """
    folder, name = os.path.split(path)
    temp = os.path.join(folder, f".{name}{TEMP_SUFFIX}")
    head = header_bytes(items, metadata)
    try:
        size, file_digest, chunk_digests = _write_temp(temp, head, items, chunk_bytes)
        os.replace(temp, path)
        fsync_dir(folder or ".")
    except OSError as exc:
        _remove_quietly(temp)
        raise OSError(exc.errno, f"writing checkpoint file {path}: {exc.strerror or exc}") from exc
    except BaseException:
        _remove_quietly(temp)
        raise
    return WrittenFile(size, file_digest.hexdigest(), chunk_bytes, chunk_digests)


def _write_temp(temp: str, head: bytes, items: list[StreamItem], chunk_bytes: int):
    file_digest = hashlib.sha256(head)
    chunks = ChunkHasher(chunk_bytes)
    chunks.update(head)
    size = len(head)
    with open(temp, "wb") as handle:
        handle.write(head)
        for item in items:
            tensor, data = _raw_bytes(item)
            chunks.update(data)
            file_digest.update(data)
            handle.write(data)
            size += len(data)
            del data
            # DiskOffload: [Note: releasing mapped pages where they are touched]
            release_resident(tensor)
        handle.flush()
        os.fsync(handle.fileno())
    return size, file_digest, chunks.finish()


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _raw_bytes(item: StreamItem) -> tuple[torch.Tensor, memoryview]:
    """The tensor ``item`` produces, and its bytes."""
    tensor = item.produce().detach()
    if tensor.dtype != item.dtype or tuple(tensor.shape) != item.shape:
        raise RuntimeError(
            f"tensor {item.key!r}: produced {tensor.dtype} {tuple(tensor.shape)}, announced "
            f"{item.dtype} {item.shape}"
        )
    return tensor, tensor_bytes(tensor)
