"""Training under a memory ceiling on each rank: with DiskOffload, and in memory.

[Note: a memory ceiling on a rank]
``RLIMIT_DATA`` limits a process's private writable memory (heap, anonymous mappings,
thread stacks), which is where tensors live, and not shared file mappings, where
``DiskOffload`` keeps master shards, gradients and Adam state. So the ceiling shows that
everything else (gathered parameters, activations, gradients before they are stored,
temporaries) fits where the model in memory does not; it says nothing about how much of
the offloaded state is resident, which would pass even if no page were ever released
(that is measured in tests/dist/residency_cases.py). The rank first does
everything a run does once per process (a warm-up run starts gloo's and shardwrap's
threads, torch's lazily made state), then sets the soft limit ``CEILING_HEADROOM`` bytes
above what it uses now (VmData); lifting it again is allowed because only the soft limit
changes. glibc is told to serve every block of 256 KiB or more from its own mapping,
returned when freed, so what the run frees does not stay counted as heap.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import resource

import torch
from torch import nn

import shardwrap
from shardwrap.offload.disk import is_file_backed
from shardwrap.policies import ModuleWrapPolicy

WIDTH, DEPTH = 768, 24  # 14.2M parameters: 57 MB fp32, 227 MB with gradients and AdamW
# Per rank, derived from what one disk-offloaded step must hold in private memory, not
# tuned on one CPU: the streamed AdamW step's sub-group (SUB_GROUP elements: its gradient
# and moments read in, and foreach temporaries, about 4 x 4 MiB) plus two gathered units
# (the one computing and the one prefetched: weight, its gradient and the flat gradient
# being reduced, 3 x 2 x 2.3 MiB), about 30 MiB. 16 MiB held on an AMD AVX-512 machine and
# failed on an Intel AMX one (a 2.3 MiB gradient refused in backward). The in-memory run
# needs its whole state (113 MB per rank) on top, so it still cannot fit.
CEILING_HEADROOM = 32 << 20
SUB_GROUP = 1 << 20  # elements stepped between page releases
STEPS = 3
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>


def vm_data() -> int:
    """This process's private writable memory (VmData), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


@contextlib.contextmanager
def ceiling(headroom: int):
    """RLIMIT_DATA at ``headroom`` bytes over the current use, for the ``with`` block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (vm_data() + headroom, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _model(width: int, depth: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _train(offload_path: str | None, width: int = WIDTH, depth: int = DEPTH):
    """Build on the meta device (one unit materialised at a time), train, return the model."""
    torch.manual_seed(0)
    offload = None if offload_path is None else shardwrap.DiskOffload(offload_path, SUB_GROUP)
    model = shardwrap.ShardedModule(
        _model(width, depth), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), cpu_offload=offload
    )
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(STEPS):
        inputs = torch.randn(8, width, generator=torch.Generator().manual_seed(step))
        model(inputs).square().mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def _out_of_memory(error: BaseException) -> bool:
    # torch's CPU allocator raises RuntimeError for a refused allocation; Python, MemoryError.
    return isinstance(error, MemoryError) or "can't allocate memory" in str(error)


# gloo's words, on a rank in a collective, when its peer's process has ended.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _peer_gone(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(words in str(error) for words in PEER_GONE)


class InMemory(enum.Enum):
    """How the in-memory run under the ceiling ended on a rank."""

    OUT_OF_MEMORY = "out of memory"  # this rank's allocation was refused
    PEER_GONE = "peer gone"  # the other rank's was, first, and it left
    FIT = "fit"  # the ceiling was not met


def _fails_in_memory() -> tuple[InMemory, str]:
    """How the in-memory run under the ceiling ended here, and the error's message.

    The ranks hold nearly the same, but not the same, memory when the ceiling is set, so one
    may be refused an allocation a step before the other: it reports and ends, and the other,
    in (or entering) a collective with it, sees its connection close. That is the ceiling
    met too, by the run as a whole, and the test requires one rank to have met it itself."""
    try:
        _train(None)
    except (MemoryError, RuntimeError) as error:
        message = f"{type(error).__name__}: {error}"
        if _out_of_memory(error):
            return InMemory.OUT_OF_MEMORY, message
        if _peer_gone(error):
            return InMemory.PEER_GONE, message
        raise
    return InMemory.FIT, ""


def trains_beyond_the_ceiling(rank: int, world_size: int, path: str) -> dict:
    """Disk offload trains under the ceiling on private memory, bit for bit as in memory;
    in memory alone it fails."""
    libc = ctypes.CDLL(None)
    for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD):
        assert libc.mallopt(option, 256 << 10) == 1
    _train(path, width=64, depth=2)  # warm-up: threads and lazily made state, once
    with ceiling(CEILING_HEADROOM):
        on_disk, optim = _train(path)
    # Master shards, their gradients (as large; dropped by zero_grad) and the AdamW state.
    state_bytes = sum(
        t.numel() * t.element_size()
        for p in on_disk.parameters()
        for t in [p, p, *optim.state[p].values()]
        if t.dim() > 0
    )
    assert all(is_file_backed(p) for p in on_disk.parameters())
    in_memory, _ = _train(None)
    for (name, kept), (_, mapped) in zip(in_memory.named_parameters(), on_disk.named_parameters()):
        torch.testing.assert_close(mapped, kept, rtol=0, atol=0, msg=name)
    del in_memory, on_disk, optim
    with ceiling(CEILING_HEADROOM):
        failure, message = _fails_in_memory()
    return {"state_bytes": state_bytes, "failure": failure.value, "message": message}
