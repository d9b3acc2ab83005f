"""An all-gather of a unit's parameters that was issued and not yet waited for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .storage import StagedShard


@dataclass(frozen=True, slots=True)
class PendingGather:
    """An all-gather into a handle's ``flat_full`` that was issued and not yet waited for."""

    work: Any  # the collective's work, or the fused bucket that fills flat_full on wait
    version: Any  # the handle's shard_version when the shard was read
    version_guard: Any  # restores flat_full's autograd version ([Note: version counters])
    input: torch.Tensor | None  # its input, alive until it is done (None: a bucket holds it)
    staged: StagedShard | None  # CPUOffload: the staged input's copy event, waited with it
    # Where the shards land when they are not slices of flat_full (1D, rank order; copied
    # out on wait: [Note: the dim-0 chunk layout] in layout/chunks.py); None: in flat_full.
    landing: torch.Tensor | None = None
