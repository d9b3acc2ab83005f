"""The dtypes one flat-parameter handle computes and reduces in.

[Note: mixed-precision data flow]
The shard (``flat_shard``) always keeps the parameters' own dtype (fp32 master weights):
the optimizer reads and updates it. When ``param_dtype`` differs, the handle keeps a
*separate* gathered buffer in ``param_dtype`` even with a single shard; gathering casts
the shard first, so the all-gather moves ``param_dtype`` bytes. Autograd accumulates local
gradients in ``param_dtype``; they are cast to ``reduce_dtype`` for the reduce-scatter /
all-reduce and back to the master dtype for the optimizer.

The cast hooks of full-precision modules are in ``assemble/casts.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..options import MixedPrecision


@dataclass(frozen=True, slots=True)
class HandlePrecision:
    """The dtypes one flat-parameter handle uses (resolved from ``MixedPrecision``)."""

    param_dtype: torch.dtype  # gathered parameters and local gradients
    reduce_dtype: torch.dtype  # gradient collectives


def handle_precision(
    policy: MixedPrecision | None, master_dtype: torch.dtype
) -> HandlePrecision | None:
    """``None`` when the policy changes nothing for parameters of ``master_dtype``."""
    if policy is None or not master_dtype.is_floating_point:
        return None
    param_dtype = policy.param_dtype or master_dtype
    reduce_dtype = policy.reduce_dtype or param_dtype
    if param_dtype == master_dtype and reduce_dtype == master_dtype:
        return None
    return HandlePrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
