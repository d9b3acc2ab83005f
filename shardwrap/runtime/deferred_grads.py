"""ZeRO-1's gradients reduced at the optimizer step when ``no_sync`` backwards left them.

[Note: ZeRO-1 reduces in backward]
ZeRO-1 (``SHARD_OPTIM``) shards only the optimizer state, yet its gradients are reduced
like ZeRO-2's: each unit's reduce-scatter is issued when the unit's backward ends and
overlaps the rest of backward, as DDP's all-reduces do, and the full local gradient is
freed once reduced. Reducing at the optimizer step instead would serialise all gradient
traffic after backward. Under ``no_sync`` full local gradients accumulate on the full
views; the next synchronising backward reduces their sum. If no synchronising backward
follows (``no_sync`` backwards, then ``optimizer.step()``), the optimizer step pre-hook
reduces what they left, so no accumulated gradient is ever dropped.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# Runtimes with ZeRO-1 reductions left for the optimizer step to flush (kept here, not in
# the registry: the registry imports the step runtime).
STEPPING: weakref.WeakSet[Any] = weakref.WeakSet()


def reduce_deferred_grads_for(optimizer: torch.optim.Optimizer) -> None:
    """Reduce unreduced ZeRO-1 gradients of every root that owns ``optimizer``'s parameters.

    For code holding only an optimizer (a grad scaler): this module knows the runtimes
    whose optimizer hooks are live.
    """
    for runtime in list(STEPPING):
        if runtime.sync_grads and runtime.owns(optimizer):
            runtime.reduce_deferred_grads()


def still_pending(pending: bool, *, sync_grads: bool, units: list, reached: list) -> bool:
    """Whether ZeRO-1 gradients stay unreduced after a backward that ran ``reached``.

    A synchronising backward reduces only the units it reached; a ZeRO-1 unit it did not
    reach may still hold gradients from an earlier ``no_sync`` backward. The execution
    order is the same on every rank, so every rank decides alike."""
    if not sync_grads:
        return True
    return pending and any(
        u.strategy.reduces_at_step and u.handle is not None for u in units if u not in reached
    )
