"""FSDP2's HSDP knobs on one unit's gradient reduction: the replica all-reduce skipped, and
the all-reduce hook. ``UnitGrads`` (``core/grads.py``) holds one :class:`ReplicaGrads`
and asks it at each point below; the FSDP2 door sets it (``fsdp2/replicas.py``).

[Note: the replica all-reduce skipped]
FSDP2's ``set_requires_all_reduce(False)`` (HSDP's gradient accumulation) reduce-scatters
a unit's gradient inside its shard group but skips the all-reduce across replicas: the
reduce-scatter output is kept, summed over such backwards (``partial_reduce_output`` in
``foreach_reduce``), and no gradient reaches the parameters; the next backward that
all-reduces adds it to its own reduce-scatter output before the all-reduce. Here the kept
sum is :attr:`ReplicaGrads.kept` (this rank's chunk, in the reduce dtype, not yet
divided), added the same way, then divided once by the data-parallel size. FSDP2 divides
by the shard size after the reduce-scatter and by the replica count after the all-reduce;
at power-of-two sizes the two divisions are exact and equal the one. The presence flags
of a skipped backward wait with the sum and count for the next assignment.

[Note: the all-reduce hook]
FSDP2's ``set_all_reduce_hook`` calls the hook, in place, on each unit's reduced chunk
once it is final: after the replica all-reduce under HSDP (never on a backward that
skipped it), after the reduce-scatter on a 1-D mesh; in the reduce dtype, and already
divided (FSDP2's collectives average), unless ``set_force_sum_reduction_for_comms(True)``
makes them sum, when the hook sees the sum and the division follows it. The engine divides
after the cast to the master dtype, so a hook is only taken where the two dtypes are one
(``fsdp2/replicas.py`` refuses it elsewhere), and runs on the same values, in the same
order. The tensor is this rank's chunk of the unit, every parameter's piece end to end,
padded at its end (FSDP2 pads each parameter's piece instead): the hook sees each
parameter element's value as FSDP2's does, in another arrangement.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class ReplicaGrads:
    """What one unit's reduction does across replicas beyond the all-reduce (see the notes)."""

    def __init__(self) -> None:
        # [Note: the replica all-reduce skipped]: False keeps the reduce-scatter output.
        self.all_reduce_grads = True
        self.kept: torch.Tensor | None = None  # 1D, this rank's chunk, reduce dtype, summed
        self._kept_present: list[bool] | None = None  # the skipped backwards' presence flags
        # [Note: the all-reduce hook]: called in place on the final reduced chunk.
        self.hook: Callable[[torch.Tensor], None] | None = None
        self.hook_sees_sum = False  # set_force_sum_reduction_for_comms(True)

    def require_all_reduce(self, value: bool) -> None:
        """Whether the next backwards all-reduce across replicas ([Note: the replica
        all-reduce skipped]); the one writer of ``all_reduce_grads``."""
        self.all_reduce_grads = value

    def keep(self, reduced: torch.Tensor) -> None:
        """Keep a reduce-scatter output whose all-reduce is skipped (summed with earlier ones)."""
        if self.kept is None:
            self.kept = reduced
        else:
            self.kept.add_(reduced)

    def discard(self) -> None:
        """Drop what skipped all-reduces kept (a failed step's: ``reset_iter_state``)."""
        self.kept = None
        self._kept_present = None

    def add_kept(self, reduced: torch.Tensor) -> None:
        """Before the all-reduce: add what skipped backwards kept to ``reduced``, in place."""
        if self.kept is not None:
            reduced.add_(self.kept)
            self.kept = None

    def divide(self, reduced: torch.Tensor, divisor: float) -> torch.Tensor:
        """``reduced`` (final, in the master dtype) divided in place by ``divisor``, the hook
        run on it before or after ([Note: the all-reduce hook])."""
        hook = self.hook
        if hook is not None and self.hook_sees_sum:
            hook(reduced)
        reduced.div_(divisor)
        if hook is not None and not self.hook_sees_sum:
            hook(reduced)
        return reduced

    def presence(self, global_present: list[bool], *, waits: bool) -> list[bool] | None:
        """The presence flags to assign with, the kept backwards' included; None when the
        assignment waits (``waits``: no gradient reached the unit) while a sum is kept."""
        if self._kept_present is not None:
            pairs = zip(self._kept_present, global_present, strict=True)
            global_present = [a or b for a, b in pairs]
            self._kept_present = None
        if waits and self.kept is not None:
            self._kept_present = list(global_present)
            return None
        return global_present
