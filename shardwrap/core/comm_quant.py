"""A sharded unit's ZeRO++ state: which gathers quantize, and its hpZ secondary shard.

[Note: ZeRO++ in a unit]
``ShardedModule(comm_quantization=CommQuantization(...))`` gives every sharded handle a
:class:`UnitCommQuant` (``handle.comm_quant``; units of one shard move nothing and get
none). The unit's training state says what the handle's next all-gather is for, and
the unit tells it at every transition (:meth:`note_phase`):

* ``FORWARD`` (the unit is idle: its next gather, or a prefetch of it, is for forward):
  with ``weights`` (qwZ) the all-gather moves block-quantized rows and every rank
  dequantizes them into the compute dtype ([Note: quantized collectives] in
  comm/quantized.py). The shard itself is never touched.
* ``BACKWARD`` (it ran forward; its next gather is for its backward): if hpZ kept a
  secondary shard (below), the gather all-gathers that over the (smaller) hpZ group;
  otherwise it is a shard-group gather as in ``FORWARD``.
* ``AFTER`` (in or after its backward): a shard-group gather as in ``FORWARD``.

[Note: every gather under qwZ is quantized]
With qwZ every shard-group gather of the parameters is quantized, whatever it is for
(forward, backward, activation checkpointing's recompute), as in DeepSpeed (its
parameter fetches pass ``quantize=zero_quantized_weights`` in forward and backward).
Quantization is deterministic, so every gather of one shard version gives the same
values, and an hpZ secondary shard is a slice of them: forward, backward and a recompute
all compute with the same (dequantized) weights, and the gradients are those of the
model with those weights. A recompute cannot be told apart by phase alone: torch's
non-reentrant checkpoint recomputes after the unit's pre-backward gather and stops as
soon as it has the tensors it needs, before the post-forward hook, so no hook could put
other values back between the recompute and backward's ops. Gathering forward-only
quantized (full precision for backward) made a checkpointed model recompute on full
precision weights forward never saw (``tests/dist/test_zeropp_recompute.py``).

hpZ: when a unit in ``BACKWARD`` phase releases its gathered parameters with grad
enabled (the reshard after forward), it first copies its slice of them for its
position in its hpZ group (``padded_numel / hpz_partition_size`` elements, compute
dtype) and keeps it, with the shard version it was gathered from. The backward gather
uses it if the shard has not changed since, and drops it; a unit that goes idle drops it
too. The slice holds what forward computed with, so under qwZ it holds the dequantized
values (backward then uses the very weights forward did, as in DeepSpeed's ZeRO++).

With ``gradients`` (qgZ) the unit's gradient reduce-scatter (alone or in a reduce
bucket) is quantized (``handle.grads.grad_codec``), and so, for hybrid strategies, is the
all-reduce of the reduced shard across replica groups (hierarchical: within the shard
group, then across, as a quantized reduce-scatter and all-gather whose bytes per rank
stay a fraction of the fp32 all-reduce's at any number of replicas, [Note: quantized
all-reduce] in comm/quantized.py). The all-reduce of one-shard units stays in full
precision.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from ..base.quantize import BlockCodec
from ..comm import quantized
from ..comm.collectives import Communicator
from ..layout.chunks import ChunkLayout
from ..layout.flat import FlatLayout
from .chunk_copy import take_shard


class GatherPhase(enum.Enum):
    FORWARD = "FORWARD"  # the unit is idle: its next gather is for forward
    BACKWARD = "BACKWARD"  # it ran forward: its next gather is for its backward
    AFTER = "AFTER"  # in or after its backward


class UnitCommQuant:
    """One handle's quantized gathers and hpZ shard ([Note: ZeRO++ in a unit])."""

    def __init__(
        self,
        *,
        weight_codec: BlockCodec | None,
        hpz_comm: Communicator | None,
    ) -> None:
        self.weight_codec = weight_codec
        self.hpz_comm = hpz_comm  # None: no hpZ (off, or its group would be the shard group)
        self.phase = GatherPhase.FORWARD
        self._secondary: torch.Tensor | None = None  # 1D, padded_numel / hpZ size
        self._secondary_version: Any = None

    @property
    def changes_gathers(self) -> bool:
        """Whether the parameter all-gathers differ from plain ones (no gather buckets)."""
        return self.weight_codec is not None or self.hpz_comm is not None

    @property
    def secondary_bytes(self) -> int:
        """Bytes the hpZ secondary shard holds now."""
        s = self._secondary
        return 0 if s is None else s.numel() * s.element_size()

    def note_phase(self, phase: GatherPhase) -> None:
        self.phase = phase
        if phase is GatherPhase.FORWARD:
            self._secondary = None

    def gather(
        self,
        shard_comm: Communicator,
        flat_full: torch.Tensor,
        shard: torch.Tensor,
        *,
        version: Any,
        unit: str,
    ):
        """Issue the all-gather of ``flat_full`` for the current phase; its waitable."""
        secondary = self._secondary
        if self.phase is GatherPhase.BACKWARD and secondary is not None:
            self._secondary = None
            if self._secondary_version == version:
                return self.hpz_comm.all_gather(flat_full, secondary, purpose="params", unit=unit)
        return quantized.all_gather(
            shard_comm, flat_full, shard, purpose="params", unit=unit, codec=self.gather_codec()
        )

    def gather_codec(self) -> BlockCodec | None:
        """The codec of a shard-group gather: qwZ's, whatever the phase ([Note: every
        gather under qwZ is quantized])."""
        return self.weight_codec

    def keep_secondary(
        self, layout: FlatLayout | ChunkLayout, flat_full: torch.Tensor, version: Any
    ) -> None:
        """Before ``flat_full`` (gathered from shard ``version``; None: not current) is
        released: keep this rank's hpZ slice of it if backward will gather it again.

        The slice is of the gathered shards in rank order (what an all-gather lands):
        under the dim-0 chunk layout that is not ``flat_full``'s order, so the slice's
        shards are taken out of it again ([Note: the dim-0 chunk layout])."""
        if (
            self.hpz_comm is None
            or version is None
            or self.phase is not GatherPhase.BACKWARD
            or not torch.is_grad_enabled()
        ):
            return
        size, position = self.hpz_comm.size, self.hpz_comm.rank
        full = flat_full.detach()
        if layout.shards_are_contiguous:
            self._secondary = full.view(size, -1)[position].clone()
        else:
            per_position = layout.num_shards // size
            first = position * per_position
            ranks = range(first, first + per_position)
            self._secondary = torch.cat([take_shard(layout, full, rank) for rank in ranks])
        self._secondary_version = version
