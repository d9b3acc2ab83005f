"""Disk offload: a unit's master shard and its Adam state in memory-mapped files.

[Note: scratch files that cannot outlive the run]
Each rank makes a private directory under the offload path and, for every buffer, a file
that is mapped (``torch.from_file(..., shared=True)``) and unlinked at once: the mapping
keeps the data, the kernel writes dirty pages back to the file and may evict them, and
no file is left behind even when the process is killed. The directory itself is removed
when the store is collected or at interpreter exit (only an empty directory can survive
a crash). The files are scratch: checkpoints, not these files, are the durable state.

[Note: releasing resident pages]
Mapped pages that were touched stay resident (file-backed) until the kernel needs the
memory, so the mapping alone does not lower a rank's resident set. After every optimizer
step the store tells the kernel it no longer needs them (``madvise(MADV_DONTNEED)``): for a
shared file mapping this drops them from the process, while their up-to-date contents stay
in the file's page cache and on disk, and the next access reads them back. Between steps
the rank then holds none of the master shards and Adam state (12 bytes per sharded
parameter element); they come back, one access at a time, while forward and the step use
them. A step streamed in sub-groups releases each sub-group's pages as soon as it is
stepped, so the step's peak holds about one sub-group of state (shardwrap/offload/disk_step.py).
Linux only; elsewhere the release is skipped.

[Note: gradients on disk]
The gradients handed to the optimizer are as large as the master shard. The store keeps
each unit's reduced gradient in a mapped buffer too (``grad_buffer``; see [Note: gradients
in a grad store] in core/grads.py), reused from step to step while nothing holds it (after
``zero_grad``), else replaced by a new one; the streamed step releases them with the rest.
Under gradient accumulation the views' gradients still hold the kept buffer when the next
backward's reduction arrives: it lands in a new buffer, which is added into them and
released with them; the buffer the gradients lie in is then no longer the kept one, so
``release_pages`` releases the gradients themselves too.

[Note: optimizer state on disk]
torch's Adam/AdamW create their state lazily (zeros and a step counter) on the first
step a parameter has a gradient. The optimizer's step pre-hook ([Note: one
optimizer-step dispatcher] in core/optimizer_step.py) creates that state beforehand, for
the same parameters, as views into one mapped buffer per unit and state name, laid out
like the shard, so the optimizer computes exactly what it would in
memory. A slot the store has not handed out before is still the file's zeros and is not
written (writing would make every page resident). Other optimizers' state would stay in
memory, so they are refused. With more than ``sub_group_size`` elements to step, the step
is streamed in sub-groups (shardwrap/offload/disk_step.py, [Note: a streamed optimizer step]).
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable

import torch

from ..base.pages import is_file_backed, release_resident
from ..core import optimizer_step
from ..core.grad_buffers import held_only_by
from ..core.optimizer_step import Phase
from ..flat_param import FlatParamHandle, holds_shards_of
from .disk_step import StreamedStep

_ADAM_STATES = ("exp_avg", "exp_avg_sq")
_LIVE_DIRECTORIES: set[str] = set()


def _remove_directory(directory: str) -> None:
    _LIVE_DIRECTORIES.discard(directory)
    shutil.rmtree(directory, ignore_errors=True)


@atexit.register
def _remove_all() -> None:
    for directory in list(_LIVE_DIRECTORIES):
        _remove_directory(directory)


def check_offload_path(path: str) -> None:
    """A clear error unless ``path`` is an existing directory this process can write to."""
    if not os.path.exists(path):
        raise ValueError(f"DiskOffload: path {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"DiskOffload: path {path!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(f"DiskOffload: cannot write to {path!r} ({error.strerror})") from None


class DiskStore:
    """One rank's mapped buffers for one ``ShardedModule``."""

    def __init__(self, path: str, rank: int, sub_group_size: int = 1_000_000_000) -> None:
        check_offload_path(path)
        self.sub_group_size = sub_group_size  # most elements stepped between page releases
        self.directory = tempfile.mkdtemp(prefix=f"shardwrap-rank{rank}-", dir=path)
        _LIVE_DIRECTORIES.add(self.directory)
        self._counter = itertools.count()
        self.handles: list[FlatParamHandle] = []
        self.num_bytes = 0  # bytes mapped so far
        # One mapped buffer per (handle, Adam state name), laid out like the shard.
        self._state_buffers: dict[tuple[int, str], torch.Tensor] = {}
        # (handle, state name, parameter index) slots given to an optimizer's state once.
        self._handed_out: set[tuple[int, str, int]] = set()
        self._mapped: list[torch.Tensor] = []  # every mapped buffer, for release_pages
        # Reduced gradients, one buffer per unit, reused while free ([Note: gradients on disk]).
        self._grad_buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # The streamed step of each optimizer seen stepping our shards.
        self._streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._finalizer = weakref.finalize(self, _remove_directory, self.directory)

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled 1-D tensor backed by a mapped (already unlinked) file."""
        tensor = self._map(name, numel, dtype)
        if numel:
            self.num_bytes += numel * tensor.element_size()
            self._mapped.append(tensor)
        return tensor

    def _map(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if numel == 0:
            return torch.zeros(0, dtype=dtype)
        safe = "".join(c if c.isalnum() else "_" for c in name)[:60] or "root"
        filename = os.path.join(self.directory, f"{next(self._counter)}-{safe}.bin")
        tensor = torch.from_file(filename, shared=True, size=numel, dtype=dtype)
        os.unlink(filename)
        return tensor

    def grad_buffer(self, owner: object, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A mapped buffer for ``owner``'s reduced gradient: the kept one if nothing holds it.

        See [Note: gradients on disk]; a new one (kept from then on) otherwise.
        """
        kept = self._grad_buffers.get(owner)
        if kept is None or kept.numel() != numel or kept.dtype != dtype or not held_only_by(kept):
            kept = self._map(f"{name}.grad", numel, dtype)
            self._grad_buffers[owner] = kept
        return kept.view(-1)

    def release_pages(self) -> None:
        """Drop the mapped buffers from this process's resident memory (data is kept).

        See [Note: releasing resident pages].
        """
        # The shard views' gradients too: under accumulation they lie in a buffer the store
        # has replaced by a new one ([Note: gradients on disk]).
        grads = [p.grad for h in self.handles for p in h.shard_params if p.grad is not None]
        for tensor in [*self._mapped, *self._grad_buffers.values(), *grads]:
            release_resident(tensor)

    def attach(self, handles: Iterable[FlatParamHandle | None]) -> None:
        """Watch every optimizer step: state for these handles' shards goes on disk."""
        self.handles = [h for h in handles if h is not None]
        for handle in self.handles:
            handle.grads.keep_reduced_in(self)
        optimizer_step.join(self, _owns, _STEP_ACTIONS)  # [Note: one optimizer-step dispatcher]

    def watch(self, optimizer: torch.optim.Optimizer) -> StreamedStep:
        """The streamed step of ``optimizer``, which steps our shards (made on its first step).

        Run after the ZeRO-1 reduction ([Note: one optimizer-step dispatcher]), so the
        gradients are in place; see [Note: a streamed optimizer step].
        """
        streamed = self._streams.get(optimizer)
        if streamed is not None:
            return streamed
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise ValueError(
                f"DiskOffload: keeps optimizer state on disk for Adam and AdamW only, got "
                f"{type(optimizer).__name__}"
            )
        streamed = StreamedStep(optimizer, self.sub_group_size)
        self._streams[optimizer] = streamed
        return streamed

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Place ``optimizer``'s state of our shards on disk, then stream their step."""
        streamed = self.watch(optimizer)
        self.place_state(optimizer)
        owned = {id(p) for h in self.handles for p in h.shard_params}
        streamed.before_step(optimizer, owned, args, kwargs)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Give back the gradients the streamed step hid from ``optimizer``'s real step."""
        streamed = self._streams.get(optimizer)
        if streamed is not None:
            streamed.after_step()

    def num_sub_groups(self, optimizer: torch.optim.Optimizer) -> int:
        """How many sub-groups ``optimizer``'s last step of our shards ran in (0: none yet)."""
        streamed = self._streams.get(optimizer)
        return streamed.num_sub_groups if streamed is not None else 0

    def place_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Put Adam/AdamW state of our shards in mapped buffers (new, or loaded into memory)."""
        mine = {id(p): (h, i) for h in self.handles for i, p in enumerate(h.shard_params)}
        # As torch does: state for a parameter once it has a gradient (or loaded state).
        ours = [
            (g, p)
            for g in optimizer.param_groups
            for p in g["params"]
            if id(p) in mine and (p.grad is not None or optimizer.state.get(p))
        ]
        for group, param in ours:
            handle, index = mine[id(param)]
            names = _ADAM_STATES + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
            for name in names:
                current = state.get(name)
                if current is not None and is_file_backed(current):
                    continue
                # A fresh state, or one optimizer.load_state_dict put back in memory.
                placed = handle.shard_view(self._state_buffer(handle, name), index)
                slot = (id(handle), name, index)
                if current is not None or slot in self._handed_out:
                    with torch.no_grad():
                        placed.copy_(current if current is not None else torch.zeros(()))
                    release_resident(placed)
                # else: the slot is still the file's zeros (not touched, not resident)
                self._handed_out.add(slot)
                state[name] = placed

    def _state_buffer(self, handle: FlatParamHandle, name: str) -> torch.Tensor:
        key = (id(handle), name)
        if key not in self._state_buffers:
            numel = handle.layout.shard_numel
            self._state_buffers[key] = self.allocate(
                f"{handle.unit_name}.{name}", numel, handle.dtype
            )
        return self._state_buffers[key]


def _owns(store: DiskStore, optimizer: torch.optim.Optimizer) -> bool:
    return holds_shards_of(optimizer, store.handles)


# What a store does around the step of an optimizer that steps its shards.
_STEP_ACTIONS = {
    Phase.PLACE_STATE: lambda store, optimizer, args, kwargs: store.before_step(
        optimizer, args, kwargs
    ),
    Phase.RESTORE_GRADS: lambda store, optimizer, args, kwargs: store.after_step(optimizer),
    Phase.RELEASE_PAGES: lambda store, optimizer, args, kwargs: store.release_pages(),
}


__all__ = ["DiskStore", "check_offload_path", "is_file_backed"]
