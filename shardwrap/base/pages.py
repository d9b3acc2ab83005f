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

[Note: fault-around]
A read fault on a file mapping maps not only the faulting page but every cached page of
a window around it (``fault_around_bytes``, 64 KiB by default): the window starts at the
aligned address at or below the fault, or at the mapping's start if that is later, and
spans 64 KiB from there. Releasing views of one buffer one after the other (a gradient's
weight piece, then its bias piece; one sub-group of a step, then the next) would
therefore leave, at each boundary, up to a window of the neighbour released just before,
mapped again by the next view's first read. So a release widens its range to every
window reading the tensor can fault in, within the tensor's storage (never past its
mapping). The pages of a neighbour it drops are read back on its next access, as always.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

_PAGE = mmap.PAGESIZE
# Released ranges are aligned to this: Linux's default fault-around window, see [Note:
# fault-around] (one page where pages are larger).
_RELEASE_ALIGN = max(_PAGE, 64 << 10)
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

    The range is widened to whole pages, and to the fault-around window within the
    storage ([Note: fault-around]): on a shared file mapping that loses no data (a
    neighbour's page is read back from the page cache on its next access).
    """
    num_bytes = tensor.numel() * tensor.element_size()
    if _libc is None or num_bytes == 0 or not is_file_backed(tensor):
        return
    storage = tensor.untyped_storage()
    # The pages holding the storage: all of one mapping (its file's).
    mapped_start = storage.data_ptr() // _PAGE * _PAGE
    mapped_end = -(-(storage.data_ptr() + storage.nbytes()) // _PAGE) * _PAGE
    start = max(mapped_start, tensor.data_ptr() // _RELEASE_ALIGN * _RELEASE_ALIGN)
    end = -(-(tensor.data_ptr() + num_bytes) // _RELEASE_ALIGN) * _RELEASE_ALIGN
    if start == mapped_start:  # the first window may be one clamped to the mapping's start
        end = max(end, mapped_start + _RELEASE_ALIGN)
    end = min(end, mapped_end)
    if _libc.madvise(start, end - start, _MADV_DONTNEED) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"DiskOffload: madvise failed: {os.strerror(error)}")
