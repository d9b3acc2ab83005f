"""A root's communicators: world, shard and replicate groups, and those of persistent units.

See [Note: parameter persistence] in ``layout/persistence.py`` for why persistent units shard over
this rank alone and replicate over the data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.collectives import CommLedger, Communicator
from ..comm.groups import GroupLayout
from ..options import ShardingStrategy


@dataclass(frozen=True)
class UnitComms:
    """The two communicators a unit's handle is built with."""

    shard: Communicator
    replicate: Communicator | None


def persistent_comms(
    strategy: ShardingStrategy, groups: GroupLayout, ledger: CommLedger
) -> UnitComms:
    """Communicators for persistent units: shard over this rank alone, replicate over all.

    The data-parallel group is the shard group itself for the flat strategies, and the
    world for hybrid ones (whose shard and replicate groups tile the world).
    """
    if strategy.is_hybrid:
        _check_spans_world(groups)
        data_parallel = groups.world_group
    elif groups.shard_group is not None:
        data_parallel = groups.shard_group
    else:  # NO_SHARD: already one shard, replicated over its group
        data_parallel = groups.replicate_group
    return UnitComms(Communicator(None, ledger), Communicator(data_parallel, ledger))


def _check_spans_world(groups: GroupLayout) -> None:
    if not groups.hybrid_spans_world:
        raise ValueError(
            "param_persistence_threshold: not supported with a hybrid device_mesh that is a "
            "slice of a bigger mesh (its replicate x shard ranks are not the world)"
        )


@dataclass(frozen=True)
class RootComms:
    """A root's communicators, all recording into its ledger."""

    world: Communicator  # every rank: the presence vote, sync_module_states
    shard: Communicator
    replicate: Communicator | None  # None: no replica groups (the flat sharded strategies)
    persistent: UnitComms | None  # units kept whole by the threshold; None: none are


def root_comms(
    groups: GroupLayout, strategy: ShardingStrategy, ledger: CommLedger, threshold: int
) -> RootComms:
    """The communicators of a root over ``groups``."""
    replicate = groups.replicate_group
    persistent = None
    if threshold and strategy is not ShardingStrategy.NO_SHARD:
        persistent = persistent_comms(strategy, groups, ledger)
    return RootComms(
        world=Communicator(groups.world_group, ledger),
        shard=Communicator(groups.shard_group, ledger),
        replicate=Communicator(replicate, ledger) if replicate is not None else None,
        persistent=persistent,
    )
