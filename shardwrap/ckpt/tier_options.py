"""Where and how often a run checkpoints: a fast memory tier and a disk tier.

[Note: checkpoint tiers]
A fault should cost the steps since the last checkpoint, and a checkpoint should cost
little. :class:`CheckpointTiers` names two locations:

* the *memory* tier, a folder on fast node-local storage (``/dev/shm``: it survives a
  worker process restart on the same machine), saved every ``memory_every`` steps. Each
  node writes its own folder ``<memory>/node-<k>/step-<n>`` and each rank also sends its
  files to one rank of the next node (:mod:`.peer_copy`), so losing one node loses no
  shard;
* the *disk* tier, a folder every rank sees (a shared file system), saved every
  ``disk_every`` steps, as ``<disk>/step-<n>``.

Each tier keeps its ``keep`` newest steps; older ones are removed only once a newer one
is committed. ``load_checkpoint`` given the tiers loads the newest complete checkpoint
whose checksums hold, and says which it took and why it skipped any (:mod:`.selection`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..base.validate import check_bool, check_int


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointTiers:
    """The two checkpoint tiers of a run; either may be ``None`` (not used)."""

    memory: str | None = None
    """Folder on node-local fast storage (each node writes ``node-<k>`` in it)."""
    memory_every: int = 1
    """Save the memory tier when ``step % memory_every == 0``."""
    disk: str | None = None
    """Folder every rank sees."""
    disk_every: int = 100
    """Save the disk tier when ``step % disk_every == 0``."""
    keep: int = 2
    """Steps each tier keeps (per node for the memory tier); at least 1."""
    peer_copy: bool = True
    """Send every rank's memory-tier files to a rank of the next node (needs 2 nodes)."""
    ranks_per_node: int | None = None
    """Ranks per node; ``None``: ranks that report the same host name share a node."""
    memory_asynchronous: bool = False
    """Save the memory tier (and send the peer copies) in the background."""
    disk_asynchronous: bool = False
    """Save the disk tier with ``save_checkpoint(..., asynchronous=True)``."""

    def __post_init__(self) -> None:
        for name in ("memory", "disk"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str | os.PathLike):
                    raise TypeError(f"{name}: expected a path or None, got {value!r}")
                object.__setattr__(self, name, os.fspath(value))
        if self.memory is None and self.disk is None:
            raise ValueError("memory, disk: at least one tier needs a folder, both are None")
        if self.memory is not None and self.memory == self.disk:
            raise ValueError(f"memory, disk: the tiers need two folders, both are {self.disk!r}")
        check_int("memory_every", self.memory_every, minimum=1)
        check_int("disk_every", self.disk_every, minimum=1)
        check_int("keep", self.keep, minimum=1)
        check_bool("peer_copy", self.peer_copy)
        check_bool("memory_asynchronous", self.memory_asynchronous)
        check_bool("disk_asynchronous", self.disk_asynchronous)
        if self.ranks_per_node is not None:
            check_int("ranks_per_node", self.ranks_per_node, minimum=1)

    def node_folder(self, node: int) -> str:
        """Node ``node``'s folder of the memory tier."""
        assert self.memory is not None
        return os.path.join(self.memory, f"node-{node:05d}")


STEP_PREFIX = "step-"


def step_folder(root: str, step: int) -> str:
    return os.path.join(root, f"{STEP_PREFIX}{step:09d}")


def saved_steps(root: str) -> dict[int, str]:
    """The step folders under ``root`` (none when it does not exist), by step."""
    if not os.path.isdir(root):
        return {}
    found = {}
    for name in os.listdir(root):
        digits = name.removeprefix(STEP_PREFIX)
        if name.startswith(STEP_PREFIX) and digits.isdigit():
            found[int(digits)] = os.path.join(root, name)
    return found
