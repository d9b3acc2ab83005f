"""Persistent units: small units kept whole on every rank instead of sharded.

This module holds the rule (which units are kept whole); the communicators they are built
with are in ``assemble/comms.py``.

[Note: parameter persistence]
A unit with few parameters costs more in collective latency than it saves in memory:
its all-gather (twice per step under ``FULL_SHARD``) moves a few kilobytes but pays a full
round of messages. ``param_persistence_threshold=T`` keeps every unit whose parameters
total fewer than ``T`` elements *persistent*: whole and replicated on every rank, exactly
as a ``HYBRID_SHARD`` unit with shard groups of one rank is built, so it reuses that
tested path:

* its shard group is this rank alone: nothing is ever all-gathered (the full tensor *is*
  the shard), and ``num_shards == 1``;
* its replicate group is the whole data-parallel group: its flat gradient is all-reduced
  (averaged) with one collective, in the same backward position as the sharded units'
  reduce-scatters, and its optimizer state is replicated.

Results are those of unsharded training, as for every other layout. Checkpoints, state
dicts, ``summon_full_params`` and gradient clipping work per unit already (a one-shard
unit is saved by the first replica only and its norm counted once).

The threshold is per *unit*, not per parameter (DeepSpeed's
``stage3_param_persistence_threshold`` is per parameter). A unit under the threshold
holds only parameters under it, so every parameter we replicate DeepSpeed would replicate
too; small parameters inside a large unit (its LayerNorms, biases) stay sharded with it.
``NO_SHARD`` replicates everything anyway, so the threshold changes nothing there.
"""

from __future__ import annotations

from ..base.validate import check_int

ARGUMENT = "param_persistence_threshold"


def check_threshold(value: object) -> int:
    """``value`` as a valid threshold (elements; 0 turns persistence off)."""
    return check_int(ARGUMENT, value, minimum=0, meaning="0 turns persistence off")


def is_persistent(num_elements: int, threshold: int) -> bool:
    """Whether a unit holding ``num_elements`` parameter elements is kept whole."""
    return 0 < num_elements < threshold
