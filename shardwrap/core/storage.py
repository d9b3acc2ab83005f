"""Where a handle's shard lives: the allocator protocol, and shards kept in host memory.

A handle gets an optional shard allocator (``(unit name, numel, dtype) -> 1-D tensor``):
``None`` keeps the shard on the compute device, ``DiskOffload`` maps it from a file, and
``CPUOffload`` keeps it in host memory. Host storage (``offload/host.py``'s ``HostStaging``)
also moves the shard to the compute device for the all-gather and the reduced gradient
back (see [Note: host shards and staging] in ``offload/host.py``); the handle recognises it
by this protocol, not by its class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

# (unit name, number of elements, dtype) -> a 1-D tensor to hold the unit's shard.
ShardAllocator = Callable[[str, int, torch.dtype], torch.Tensor]


@dataclass(frozen=True, slots=True)
class StagedShard:
    """A shard copied to the compute device, and the event marking the copy's end."""

    tensor: torch.Tensor  # 1D, shard_numel, compute dtype, on the compute device
    copied: Any  # torch.cuda.Event of an asynchronous copy, or None when it blocked

    def wait_copied(self) -> None:
        """Block the host until the copy has read the host shard."""
        if self.copied is not None:
            self.copied.synchronize()


@runtime_checkable
class HostStorage(Protocol):
    """A shard allocator whose shards live in host memory and cross to the device."""

    def __call__(self, unit_name: str, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def to_device(
        self, host_shard: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> StagedShard:
        """A copy of ``host_shard`` on ``device`` in ``dtype``, and its copy event."""
        ...

    def to_host(self, device_tensor: torch.Tensor) -> torch.Tensor:
        """A new host tensor holding ``device_tensor``'s values (1-D)."""
        ...


@runtime_checkable
class GradStore(Protocol):
    """Where a unit's reduced gradients are kept until the optimizer steps (``DiskOffload``).

    See [Note: gradients in a grad store] in ``core/grads.py``.
    """

    def grad_buffer(self, owner: object, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements for ``owner``'s reduced gradient (contents
        undefined) that nothing else holds: the one kept for ``owner`` when it is free."""
        ...
