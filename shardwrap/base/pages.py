"""Dropping a memory-mapped tensor's pages from this process (Linux ``madvise``).

[Note: releasing mapped pages where they are touched]
``DiskOffload`` keeps master shards, gradients handed to the optimizer and Adam state in
shared file mappings (shardwrap/offload/disk.py). A page of such a mapping that the process
touched stays in its resident set until the kernel needs the memory, so whatever reads or
writes the whole shard (materialising it, gathering it for forward and backward, the
optimizer step, a checkpoint save) would leave all of it resident. Each of those places
therefore releases the range it has just used (``madvise(MADV_DONTNEED)``): for a shared
file mapping that drops the pages from the process and keeps their contents in the file's
page cache and on disk, so the next access reads them back. On anything but a shared file
mapping (ordinary memory) the release does nothing, so the callers need not know where a
tensor lives. Linux only; elsewhere it is skipped.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # <sys/mman.h> on Linux
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _libc is not None:
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.madvise.restype = ctypes.c_int


def is_file_backed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is a mapped file (never a tensor subclass's, a DTensor's)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu":
        return False
    return tensor.untyped_storage().filename is not None


def release_resident(tensor: torch.Tensor) -> None:
    """Drop the pages that hold ``tensor`` from this process, if it is a mapped file.

    The range is widened to whole pages: on a shared file mapping that loses no data (a
    neighbour's page is read back from the page cache on its next access).
    """
    num_bytes = tensor.numel() * tensor.element_size()
    if _libc is None or num_bytes == 0 or not is_file_backed(tensor):
        return
    start = tensor.data_ptr() // _PAGE * _PAGE
    end = -(-(tensor.data_ptr() + num_bytes) // _PAGE) * _PAGE
    if _libc.madvise(start, end - start, _MADV_DONTNEED) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"DiskOffload: madvise failed: {os.strerror(error)}")
