"""CPU offload: a unit's master shard in host memory, staged through the compute device.

[Note: host shards and staging]
With ``CPUOffload(offload_params=True)`` a unit's flat shard (the master weights), the
shard views the optimizer holds, their gradients and so the optimizer's state live in
host memory: pinned when CUDA is available, so that copies to the device need not block
the host. The gathered buffer, the local gradients and every collective stay on the
compute device. Data crosses between the two in exactly two places, both explicit:

* unshard: the host shard is copied into a fresh staging buffer on the compute device,
  cast to the compute dtype there, and that buffer is the all-gather's input;
* gradient reduction: the reduced shard gradient (reduce-scatter, replica all-reduce and
  scaling all on the device) is copied into a new host tensor, which becomes the shard
  views' ``.grad``; ``optimizer.step()`` then runs on the CPU over host shards and state.

On a CPU-only run both copies still happen (host and compute device are the same CPU):
redundant, but the very code an accelerator run uses, and exact (copies and casts
change no value), so results equal those without offload bit for bit.

[Note: asynchronous copies from pinned memory]
A non-blocking host-to-device copy reads the host shard after the call has returned; the
host must not write that shard (an optimizer step, a checkpoint load, a summon's
writeback) until the copy is done. The copy therefore records a CUDA event, and the
handle waits for it where it waits for the all-gather it feeds: by then the data sits in
the device staging buffer. The copy of a reduced gradient to the host blocks, because
the optimizer reads it next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.storage import StagedShard
from ..options import CPUOffload


@dataclass(frozen=True, slots=True)
class HostStaging:
    """Where offloaded shards live and how they cross to the compute device and back.

    It implements ``storage.HostStorage``, and so is also the handle's shard allocator
    (``(unit name, numel, dtype) -> tensor``): see [Note: host shards and staging].
    """

    pin_memory: bool  # page-locked host buffers; only ever True when CUDA is available

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"pin_memory: expected a bool, got {self.pin_memory!r}")
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory: True needs CUDA, and torch.cuda.is_available() is False")

    @classmethod
    def for_this_process(cls) -> HostStaging:
        """Pinned host memory where CUDA is available, plain host memory otherwise."""
        return cls(pin_memory=torch.cuda.is_available())

    def __call__(self, unit_name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D host buffer for ``unit_name``'s shard."""
        return self.host_empty(numel, dtype)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin_memory)

    def to_device(
        self, host_shard: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> StagedShard:
        """Copy ``host_shard`` into a new buffer on ``device``, then cast it to ``dtype``.

        Always a copy, also when ``device`` is the CPU: ``host_shard`` may change (an
        optimizer step) while the staged copy is still being gathered.
        """
        staged = torch.empty(host_shard.shape, dtype=host_shard.dtype, device=device)
        asynchronous = self.pin_memory and staged.device.type == "cuda"
        staged.copy_(host_shard, non_blocking=asynchronous)
        copied = None
        if asynchronous:  # [Note: asynchronous copies from pinned memory]
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(staged.device))
        return StagedShard(staged.to(dtype), copied)

    def to_host(self, device_tensor: torch.Tensor) -> torch.Tensor:
        """A new host tensor holding ``device_tensor``'s values (1-D); the copy blocks."""
        host = self.host_empty(device_tensor.numel(), device_tensor.dtype)
        host.copy_(device_tensor.reshape(-1))
        return host


def host_staging_for(cpu_offload: object) -> HostStaging | None:
    """The staging that ``cpu_offload`` asks for (``None``: shards stay on the device)."""
    if isinstance(cpu_offload, CPUOffload) and cpu_offload.offload_params:
        if cpu_offload.pin_memory is None:
            return HostStaging.for_this_process()
        return HostStaging(pin_memory=cpu_offload.pin_memory)
    return None


__all__ = ["HostStaging", "host_staging_for"]
