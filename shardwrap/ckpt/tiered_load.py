"""``load_checkpoint`` of several locations: choose the newest good one, bring back what a
node lacks, load.

Given a :class:`~.tier_options.CheckpointTiers` or a list of folders, every rank runs
:func:`~.selection.newest_checkpoint` ([Note: choosing among checkpoints]). A memory-tier
checkpoint is then made whole on every node before the one-folder load reads it: each
node's folder may lack files (a replaced node has none; every node lacks the files of
ranks other than its own and its peer source's), so

1. a node whose folder lacks the index gets it from a rank whose folder holds it;
2. every rank lists the files its load will open (``loading.files_to_read``: from the
   index and its current layout, at any world size), and each file its node's folder
   does not hold verified comes from the lowest rank whose folder does, once per node
   ([Note: file bundles] in peer_copy.py: its digest checked on arrival);

each step settled across ranks. Then every rank loads its node's folder as one checkpoint
(``loading.load_checkpoint``, which verifies every chunk it reads again).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.json_values import all_gather_json
from . import async_save, loading
from .format import INDEX_NAME, CheckpointError, read_index
from .outcome import guarded, settle
from .peer_copy import Transfer, run_transfers
from .selection import Locations, Selection, Tier, choose
from .slots import ModelSlots, model_slots
from .tier_options import CheckpointTiers
from .tiered_save import memory_nodes

logger = logging.getLogger("shardwrap.checkpoint")


@dataclass(frozen=True, slots=True)
class Resumed:
    """What :func:`load_newest` loaded: the choice (and what it skipped, why) and the
    checkpoint's ``extra``."""

    selection: Selection
    extra: Any


def load_checkpoint(
    path: str | os.PathLike | CheckpointTiers | list | tuple,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    sampler: Any = None,
    restore_rng: bool = True,
) -> Any:
    """:func:`~shardwrap.ckpt.loading.load_checkpoint` of one folder, or of the newest good
    checkpoint among several (a ``CheckpointTiers``, or folders, preferred first); world
    rank 0 logs the choice (logger ``shardwrap.checkpoint``: at INFO, or at WARNING with
    every skipped candidate and its reason). Returns the checkpoint's ``extra``."""
    if isinstance(path, str | os.PathLike):
        return loading.load_checkpoint(
            path, model, optimizer, strict=strict, sampler=sampler, restore_rng=restore_rng
        )
    resumed = load_newest(
        path, model, optimizer, strict=strict, sampler=sampler, restore_rng=restore_rng
    )
    return resumed.extra


def load_newest(
    locations: CheckpointTiers | list | tuple,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    sampler: Any = None,
    restore_rng: bool = True,
) -> Resumed:
    """Load the newest complete checkpoint whose checksums hold; call on every rank."""
    slots = model_slots(model)
    places = _locations(locations, model)
    selection = choose(places)
    comm = slots.world_comm
    if comm.rank == 0:  # a skip is news (printed even where logging is not set up)
        level = logging.WARNING if selection.skipped else logging.INFO
        logger.log(level, "load_checkpoint: %s", selection.describe())
    if selection.chosen is None:
        raise CheckpointError(f"load_checkpoint: no loadable checkpoint: {selection.describe()}")
    if selection.chosen.tier is Tier.MEMORY:
        _make_whole(selection, slots, places.nodes, optimizer, strict)
    extra = loading.load_checkpoint(
        selection.path, model, optimizer, strict=strict, sampler=sampler, restore_rng=restore_rng
    )
    return Resumed(selection, extra)


def newest_checkpoint(locations: CheckpointTiers | list | tuple, model: Any) -> Selection:
    """The newest complete checkpoint whose checksums hold among ``locations``, which it
    skipped and why; the same on every rank (call on every rank: each verifies its share
    of the files). Loads nothing."""
    return choose(_locations(locations, model))


def _locations(locations: CheckpointTiers | list | tuple, model: Any) -> Locations:
    """The candidates' places as this rank sees them, the memory tier's nodes found once
    (an all-gather of host names unless ``ranks_per_node`` is given)."""
    comm = model_slots(model).world_comm
    tiers, paths = _parse_locations(locations)
    async_save.wait_for_previous(model)  # a save in the background may be of these tiers
    nodes = memory_nodes(tiers, comm) if tiers is not None and tiers.memory else None
    return Locations(comm, tiers, nodes, paths)


def _parse_locations(locations) -> tuple[CheckpointTiers | None, list[str]]:
    if isinstance(locations, CheckpointTiers):
        return locations, []
    if isinstance(locations, list | tuple) and locations:
        paths = []
        for item in locations:
            if not isinstance(item, str | os.PathLike):
                raise TypeError(f"path: expected folders, got {type(item).__name__} in the list")
            paths.append(os.fspath(item))
        if len(set(paths)) != len(paths):
            raise ValueError(f"path: a folder is given twice in {paths}")
        return None, paths
    raise TypeError(
        "path: expected a folder, a non-empty list of folders or a CheckpointTiers, got "
        f"{type(locations).__name__}"
    )


def _make_whole(selection: Selection, slots: ModelSlots, nodes, optimizer, strict) -> None:
    """Bring every file this node's ranks will read into its folder (module docstring)."""
    comm, folder = slots.world_comm, selection.path
    assert folder is not None and nodes is not None
    on_node = {name: {nodes.node_of(r) for r in ranks} for name, ranks in selection.holders.items()}
    index_to = [
        Transfer(selection.holders[INDEX_NAME][0], nodes.ranks_of(node)[0], (INDEX_NAME,))
        for node in range(nodes.num_nodes)
        if node not in on_node[INDEX_NAME]
    ]
    fetching = guarded(lambda: run_transfers(comm, index_to, folder, None, selection.digests))
    settle(comm, "load", folder, fetching.error)
    planned = guarded(lambda: loading.files_to_read(folder, slots, optimizer, strict=strict))
    node = nodes.node_of(comm.rank)
    wanted = sorted(n for n in (planned.value or ()) if node not in on_node.get(n, ()))
    every_want = all_gather_json(comm, wanted, purpose="checkpoint")
    settle(comm, "load", folder, planned.error)
    transfers = _file_transfers(every_want, selection.holders, nodes)
    index = guarded(lambda: read_index(folder))
    settle(comm, "load", folder, index.error)
    fetching = guarded(
        lambda: run_transfers(comm, transfers, folder, index.value, selection.digests)
    )
    settle(comm, "load", folder, fetching.error)


def _file_transfers(every_want: list[list[str]], holders, nodes) -> list[Transfer]:
    """One transfer per (sender, receiving rank): each file a node wants once, to the
    node's lowest rank that wants it, from the lowest rank whose folder holds it."""
    receivers: dict[tuple[int, str], int] = {}
    for rank, names in enumerate(every_want):
        for name in names:
            receivers.setdefault((nodes.node_of(rank), name), rank)
    pairs: dict[tuple[int, int], list[str]] = {}
    for (_, name), receiver in sorted(receivers.items()):
        pairs.setdefault((holders[name][0], receiver), []).append(name)
    return [Transfer(s, r, tuple(names)) for (s, r), names in sorted(pairs.items())]
