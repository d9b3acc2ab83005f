"""Where a unit's summed gradient is divided: once after the cast, or around the sum.

[Note: float16 reductions divided around the sum]
By default a unit sums its gradients in the reduce dtype and divides the sum once, after
the cast to the master dtype. FSDP2 does that for float32 and bfloat16, whose range a sum
of a few ranks cannot leave, but divides a float16 sum in two steps, both in float16, to
keep it in range: each rank's gradient before the reduce-scatter, the reduced (and, under
HSDP, all-reduced) chunk after it, by the two factors of :func:`split_divisor`. A unit
told ``UnitGrads.divide_around_reduction`` (the FSDP2 door's float16 reductions) does the
same; the FSDP1 and DeepSpeed doors keep the one division after the cast.
"""

from __future__ import annotations

import torch


def split_divisor(factor: float) -> tuple[float, float]:
    """FSDP2's division of a float16 gradient sum by ``factor``, as (before the sum,
    after it): the first starts at 1 and doubles while it divides ``factor`` and is under
    ``factor`` over it (about the square root), the second is what is left."""
    before = 1
    while factor % before == 0 and factor / before > before:
        before *= 2
    return float(before), factor / before


def divide_before_sum(flat_grad: torch.Tensor, divisor: float, *, around: bool) -> None:
    """Divide a rank's flat gradient, in place, by the part of ``divisor`` that comes
    before the sum (none unless ``around``)."""
    if around:
        _divide_unless_one(flat_grad, split_divisor(divisor)[0])


def divide_after_sum(reduced: torch.Tensor, divisor: float, *, around: bool) -> float:
    """Divide a reduced chunk, in place in its reduce dtype, by what must be divided
    there (the rest of a division ``around`` the sum); what is left to divide by after
    the cast to the master dtype."""
    if not around:
        return divisor
    _divide_unless_one(reduced, split_divisor(divisor)[1])
    return 1.0


def _divide_unless_one(tensor: torch.Tensor, divisor: float) -> None:
    if divisor != 1:
        tensor.div_(divisor)
