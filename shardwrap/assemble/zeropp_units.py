"""Switching ZeRO++ on for a root's new units: codecs on their handles, the hpZ groups.

See [Note: ZeRO++ in a unit] in core/comm_quant.py for what each switch does.
"""

from __future__ import annotations

from ..comm.collectives import Communicator, group_ranks, new_subgroups, world_rank
from ..core.comm_quant import UnitCommQuant
from ..core.unit import Unit
from ..options import CommQuantization
from .comms import RootComms


def quantize_comms(
    config: CommQuantization | None, units: list[Unit], comms: RootComms
) -> CommQuantization | None:
    """Equip the sharded handles of ``units`` with ``config`` (returned as given)."""
    if config is None or not config.enabled:
        return config
    hpz = hpz_communicator(config.hpz_partition_size, comms)
    for unit in units:
        handle = unit.handle
        if handle is None or handle.num_shards == 1:  # moves nothing worth quantizing
            continue
        handle.comm_quant = UnitCommQuant(
            weight_codec=config.weight_codec,
            hpz_comm=hpz if handle.shard_comm is comms.shard else None,
        )
        handle.grads.grad_codec = config.gradient_codec
    return config


def hpz_communicator(size: int, comms: RootComms) -> Communicator | None:
    """The hpZ group of this rank: ``size`` consecutive ranks of its shard group.

    None when hpZ is off or its group would be the whole shard group. Every rank makes
    every hpZ group (torch requires all ranks to create each group), so the shard groups
    are first shared over the world; they must tile it.
    """
    shard = comms.shard
    if size == 1 or shard.size == 1:
        return None
    if shard.size % size:
        raise ValueError(
            f"hpz_partition_size: {size} does not divide the shard group's size {shard.size}"
        )
    if size == shard.size:
        return None
    mine = tuple(group_ranks(shard.group))
    every = comms.world.all_gather_object(mine, purpose="hpz_groups")
    shard_groups = list(dict.fromkeys(every))  # each once, in rank order
    members = [rank for group in shard_groups for rank in group]
    if len(members) != len(set(members)) or len(members) != comms.world.size:
        raise ValueError(
            "hpz_partition_size: the shard groups do not tile the world "
            f"({shard_groups}); hpZ needs every rank in exactly one shard group"
        )
    rank_lists = [list(g[i : i + size]) for g in shard_groups for i in range(0, len(g), size)]
    groups = new_subgroups(rank_lists)
    me = world_rank()
    group = next(g for ranks, g in zip(rank_lists, groups, strict=True) if me in ranks)
    return Communicator(group, shard.ledger)
