"""Process-group layout: which ranks shard together and which replicate.

A strategy works over two groups: the *shard* group (ranks that split each unit's flat
parameter) and the optional *replicate* group (ranks that hold the same shard and
all-reduce its gradient). ``NO_SHARD`` is the degenerate case: shard groups of one rank,
replication across the whole group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..options import ShardingStrategy
from . import collectives

# [Note: offline groups]
# torch's FSDP1 takes any ``process_group`` that answers ``rank()`` and ``size()`` as long
# as nothing communicates: wrapping and sharding need no collective, and torch's own wrap
# tests hand it a ``DummyProcessGroup`` (rank and size only) to check which modules become
# units. shardwrap takes such an object too, for one flat group (not hybrid, not a mesh):
# the model is wrapped and sharded as rank ``rank()`` of ``size()`` (a group of one trains,
# since it needs no collective), the wrap-time agreement check has no rank to ask and is
# skipped, and any collective of a bigger group raises a ``RuntimeError`` saying so.


@dataclass(frozen=True)
class GroupLayout:
    """The two groups a root's units communicate over (``None``: a group of just this rank)."""

    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    world_group: dist.ProcessGroup  # every rank of this root (the data-parallel group)

    @property
    def hybrid_spans_world(self) -> bool:
        """Whether the shard and replicate groups tile the whole world."""
        sizes = [dist.get_world_size(g) for g in (self.shard_group, self.replicate_group)]
        return sizes[0] * sizes[1] == dist.get_world_size(self.world_group)


def hybrid_process_groups(shard_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Tile the world into shard groups of ``shard_size`` consecutive ranks.

    Returns ``(shard_group, replicate_group)`` for this rank. Every rank must call it.
    """
    if not collectives.is_initialized():
        raise RuntimeError("hybrid_process_groups: call torch.distributed.init_process_group first")
    world = collectives.world_size()
    if not isinstance(shard_size, int) or shard_size < 1 or world % shard_size:
        raise ValueError(
            f"hybrid_process_groups: shard_size={shard_size!r} does not tile the world of "
            f"{world} ranks (it must be a positive divisor of {world})"
        )
    num_replicas = world // shard_size
    shard_lists = [list(range(i * shard_size, (i + 1) * shard_size)) for i in range(num_replicas)]
    replicate_lists = [list(range(j, world, shard_size)) for j in range(shard_size)]
    shard_groups = collectives.new_subgroups(shard_lists)
    replicate_groups = collectives.new_subgroups(replicate_lists)
    rank = collectives.world_rank()
    return shard_groups[rank // shard_size], replicate_groups[rank % shard_size]


def _offline_layout(strategy: ShardingStrategy, group: object, device_mesh: object) -> GroupLayout:
    if strategy.is_hybrid or device_mesh is not None:
        raise ValueError(
            f"process_group: a {type(group).__name__} (rank and size only) can shard one "
            f"flat group, not {strategy.name} or a device_mesh; pass ProcessGroups"
        )
    rank, size = group.rank(), group.size()  # type: ignore[attr-defined]
    if not (isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size):
        raise ValueError(
            f"process_group: {type(group).__name__} answers rank() = {rank!r}, size() = "
            f"{size!r}; expected integers with 0 <= rank < size"
        )
    if strategy is ShardingStrategy.NO_SHARD:
        return GroupLayout(None, group, group)  # type: ignore[arg-type]
    return GroupLayout(group, None, group)  # type: ignore[arg-type]


def resolve_groups(
    strategy: ShardingStrategy, process_group: object, device_mesh: object
) -> GroupLayout:
    """Validate ``process_group``/``device_mesh`` for ``strategy`` and pick the two groups.

    Without a default process group (torch FSDP1 allows this when ``process_group`` is
    given), the given group is the model's whole world: checkpoints and checks run over it.
    An offline group ([Note: offline groups]) is taken for what it says it is.
    """
    if collectives.is_offline_group(process_group):
        return _offline_layout(strategy, process_group, device_mesh)
    if not collectives.is_initialized():
        _check_without_default(strategy, process_group, device_mesh)
    if strategy.is_hybrid:
        shard_group, replicate_group = _hybrid_groups(process_group, device_mesh)
        # A 2-D mesh may be a slice of a bigger one (data parallel inside tensor or pipeline
        # parallelism): it tiles its own ranks, not necessarily the world.
        _check_tiles(shard_group, replicate_group, whole_world=device_mesh is None)
        return GroupLayout(shard_group, replicate_group, collectives.default_group())
    if device_mesh is not None:
        if getattr(device_mesh, "ndim", 1) != 1:
            raise ValueError(
                f"device_mesh: {strategy.name} needs a 1-D mesh, got {device_mesh.ndim} dims"
            )
        group = device_mesh.get_group()
    elif process_group is None:
        group = collectives.default_group()
    elif isinstance(process_group, dist.ProcessGroup):
        group = process_group
    else:
        raise TypeError(
            f"process_group: {strategy.name} takes one ProcessGroup, got {type(process_group)}"
        )
    _check_member(group, "process_group")
    # The root's world is its data-parallel group: a pipeline stage's root must not vote
    # or broadcast with the ranks of other stages ([Note: ZeRO inside pipeline stages]).
    if strategy is ShardingStrategy.NO_SHARD:
        return GroupLayout(None, group, group)
    return GroupLayout(group, None, group)


def _check_without_default(
    strategy: ShardingStrategy, process_group: object, device_mesh: object
) -> None:
    """Without a default group only one given ``ProcessGroup`` can work (it is the world)."""
    if process_group is None and device_mesh is None:
        raise RuntimeError(
            "ShardedModule: no process group is initialised; call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment) "
            "or pass process_group="
        )
    if strategy.is_hybrid or not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(
            f"process_group: without a default process group {strategy.name} needs one "
            f"ProcessGroup (got {type(process_group).__name__}); hybrid sharding and "
            "device_mesh need torch.distributed.init_process_group(...) first"
        )


def _hybrid_groups(process_group: object, device_mesh: object):
    if device_mesh is not None:
        if getattr(device_mesh, "ndim", None) != 2:
            raise ValueError("device_mesh: hybrid sharding needs a 2-D mesh (replicate, shard)")
        return device_mesh.get_group(1), device_mesh.get_group(0)
    if (
        isinstance(process_group, tuple)
        and len(process_group) == 2
        and all(isinstance(g, dist.ProcessGroup) for g in process_group)
    ):
        return process_group
    raise ValueError(
        "process_group: hybrid sharding needs process_group=(shard_group, replicate_group) "
        "or a 2-D device_mesh; shardwrap.hybrid_process_groups(shard_size) builds both"
    )


def _check_member(group: dist.ProcessGroup, argument: str) -> None:
    if not isinstance(group, dist.ProcessGroup) or group.rank() < 0:
        raise ValueError(f"{argument}: rank {collectives.world_rank()} is not a member")


def _check_tiles(
    shard_group: dist.ProcessGroup, replicate_group: dist.ProcessGroup, *, whole_world: bool
) -> None:
    _check_member(shard_group, "process_group[0] (shard group)")
    _check_member(replicate_group, "process_group[1] (replicate group)")
    shard_size = dist.get_world_size(shard_group)
    replicate_size = dist.get_world_size(replicate_group)
    world = collectives.world_size()
    shard_ranks = set(collectives.group_ranks(shard_group))
    replicate_ranks = set(collectives.group_ranks(replicate_group))
    spans = shard_size * replicate_size == world or not whole_world
    if not spans or shard_ranks & replicate_ranks != {collectives.world_rank()}:
        raise ValueError(
            f"process_group: shard group {sorted(shard_ranks)} x replicate group "
            f"{sorted(replicate_ranks)} does not tile the world of {world} ranks "
            f"(need shard_size * replicate_size == {world}, meeting only at this rank)"
        )


def side_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new gloo group over the ranks of ``group``, for work beside the training's.

    Collectives issued from another thread (an asynchronous checkpoint's commit) must not
    share a group with the training thread's: two threads' collectives on one group
    interleave differently on each rank. Every rank of the default group calls this, in
    the same order (torch numbers groups by creation; a group named by its ranks alone
    would reuse the store keys of an earlier one over the same ranks).
    """
    if not collectives.is_initialized():
        raise ValueError(
            "asynchronous: needs torch.distributed initialised (a default process group), to "
            "create the background save's own group"
        )
    return dist.new_group(collectives.group_ranks(group), backend="gloo")
