"""Weighting per-rank losses when ranks see different numbers of samples.

Gradients are averaged over ranks with equal weights, so a per-rank *mean* loss gives the
mean of the per-rank means. When local batch sizes differ that is not the mean over the
concatenated batch; multiplying each rank's mean loss by
``local_count * world_size / global_count`` makes it so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..runtime.step import StepRuntime


def batch_weight(runtime: StepRuntime, local_count: int) -> float:
    """Factor for this rank's mean loss so that gradients equal the global-batch mean.

    Every rank must call it (one all-reduce of the sample counts).
    """
    if isinstance(local_count, bool) or not isinstance(local_count, int) or local_count < 0:
        raise ValueError(f"local_count: expected a non-negative int, got {local_count!r}")
    comm = runtime.world_comm
    total = torch.tensor([local_count], dtype=torch.int64)
    comm.all_reduce(total, purpose="batch_size").wait()
    if int(total) == 0:
        raise ValueError("local_count: every rank passed 0 samples")
    return local_count * comm.size / int(total)
