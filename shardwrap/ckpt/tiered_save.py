"""``save_tiered``: the training loop's one call per step ([Note: checkpoint tiers]).

A memory-tier save is ``save_checkpoint`` into this node's folder
``<memory>/node-<k>/step-<n>`` (world rank 0 commits the index into its own node's),
then three steps on the save's group (its ``after_save``: in the background for an
asynchronous save, with ``memory_asynchronous``), each settled across ranks (a failure
raises on every rank, or from every rank's ``result()``):

1. world rank 0 broadcasts the index's bytes; every other node's first rank writes them
   into its node's folder, so each node's folder is a checkpoint folder of its own;
2. with ``peer_copy``, every rank sends its files (its safetensors file and run file) to
   its peer on the next node (:mod:`.nodes`), which checks their digests and writes them
   into its node's folder ([Note: file bundles] in peer_copy.py);
3. each node's first rank removes files of an earlier save of the same step from its
   node's folder, and prunes the folder to the ``keep`` newest steps.

A disk-tier save is ``save_checkpoint`` into ``<disk>/step-<n>`` (asynchronous with
``disk_asynchronous``); world rank 0 prunes the disk tier once its index is committed
(``on_commit``, on the background thread for an asynchronous save).

Pruning keeps the step just saved and the ``keep - 1`` newest steps before it; step
folders *after* it are removed too: they belong to a run that was rolled back to an
earlier checkpoint, and a later load must not prefer them.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from ..base.validate import check_int
from ..comm.collectives import Communicator
from ..comm.json_values import broadcast_json
from .async_save import AsyncSave
from .format import (
    INDEX_NAME,
    CheckpointIndex,
    parse_index,
    remove_stale_files,
    shard_file_name,
    write_atomic,
)
from .nodes import NodeMap, node_map
from .outcome import guarded, settle
from .peer_copy import copy_to_peer
from .run_state import META_KEY, run_file_name
from .save import save_checkpoint
from .slots import model_slots
from .tier_options import CheckpointTiers, saved_steps, step_folder


@dataclass(frozen=True, slots=True)
class TierSaves:
    """What one ``save_tiered`` call saved (``None``: that tier was not due)."""

    memory: str | AsyncSave | None  # this rank's node folder of the step (copies written),
    # or the handle of its asynchronous save (copies written before its result())
    disk: str | AsyncSave | None  # the disk folder, or the handle of its asynchronous save


def save_tiered(
    tiers: CheckpointTiers,
    step: int,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Any = None,
    sampler: Any = None,
) -> TierSaves:
    """Save each tier that is due at ``step``; call on every rank after each step.

    ``extra`` and ``sampler`` as for :func:`~shardwrap.save_checkpoint`.
    """
    if not isinstance(tiers, CheckpointTiers):
        raise TypeError(f"tiers: expected a CheckpointTiers, got {type(tiers).__name__}")
    check_int("step", step, minimum=0)
    memory = disk = None
    if tiers.memory is not None and step % tiers.memory_every == 0:
        memory = _save_memory(tiers, step, model, optimizer, extra, sampler)
    if tiers.disk is not None and step % tiers.disk_every == 0:
        folder = step_folder(tiers.disk, step)
        prune = functools.partial(prune_steps, tiers.disk, step, tiers.keep)
        handle = save_checkpoint(
            folder,
            model,
            optimizer,
            extra=extra,
            sampler=sampler,
            asynchronous=tiers.disk_asynchronous,
            on_commit=prune,
        )
        disk = folder if handle is None else handle
    return TierSaves(memory, disk)


def memory_nodes(tiers: CheckpointTiers, comm: Communicator) -> NodeMap:
    """The nodes the memory tier is spread over (refuses ``peer_copy`` on one node)."""
    nodes = node_map(comm, tiers.ranks_per_node)
    if tiers.peer_copy and nodes.num_nodes < 2:
        raise ValueError(
            f"peer_copy: the {comm.size} rank(s) form one node ({nodes.ranks_per_node} per "
            "node), so there is no other node to copy to; pass peer_copy=False"
        )
    return nodes


def _save_memory(tiers, step, model, optimizer, extra, sampler) -> str | AsyncSave:
    comm = model_slots(model).world_comm
    nodes = memory_nodes(tiers, comm)
    folder = step_folder(tiers.node_folder(nodes.node_of(comm.rank)), step)
    handle = save_checkpoint(
        folder,
        model,
        optimizer,
        extra=extra,
        sampler=sampler,
        asynchronous=tiers.memory_asynchronous,
        after_save=functools.partial(_spread_and_copy, tiers, nodes, step),
    )
    return folder if handle is None else handle


def _spread_and_copy(tiers: CheckpointTiers, nodes: NodeMap, step: int, comm: Communicator) -> None:
    """After the save of ``step`` into every node's folder: steps 1-3 of the module's
    docstring, on the save's group ``comm`` (the background one for an asynchronous save;
    its ranks are the world's)."""
    node = nodes.node_of(comm.rank)
    root = tiers.node_folder(node)
    folder = step_folder(root, step)
    raw = _broadcast_index(comm, folder)
    leads_node = nodes.local_index(comm.rank) == 0

    def spread() -> CheckpointIndex:
        if leads_node and node != nodes.node_of(0):
            write_atomic(folder, INDEX_NAME, raw)
        return parse_index(folder, json.loads(raw))

    spreading = guarded(spread)
    settle(comm, "save", folder, spreading.error)
    index = spreading.value
    assert index is not None  # settled
    if tiers.peer_copy:
        own = own_files(index, comm.rank)
        copying = guarded(lambda: copy_to_peer(comm, nodes, folder, own, index))
        settle(comm, "peer copy", folder, copying.error)

    def tidy() -> None:  # files of an earlier save of this step, then older steps
        if leads_node:
            remove_stale_files(folder, keep=set(index.files), save_id=index.meta["save_id"])
            prune_steps(root, step, tiers.keep)

    settle(comm, "prune", root, guarded(tidy).error)


def own_files(index: CheckpointIndex, rank: int) -> list[str]:
    """The files world rank ``rank`` wrote in the save of ``index``."""
    save_id = str(index.meta.get("save_id"))
    names = (
        [shard_file_name(save_id, rank)] if shard_file_name(save_id, rank) in index.files else []
    )
    if index.meta.get(META_KEY) is not None:
        names.append(run_file_name(save_id, rank))
    return names


def _broadcast_index(comm: Communicator, folder: str) -> bytes:
    """World rank 0's ``index.json`` bytes, on every rank (empty if it cannot read it:
    the spread then fails on every rank). Sent as text, so the bytes arrive unchanged (the
    index's digest is compared across nodes)."""
    text = ""
    if comm.rank == 0:
        path = os.path.join(folder, INDEX_NAME)
        text = guarded(lambda: _read_bytes(path).decode("utf-8")).value or ""
    return broadcast_json(comm, text, purpose="checkpoint").encode("utf-8")


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def prune_steps(root: str, step: int, keep: int) -> list[int]:
    """Remove ``root``'s step folders but ``step`` and the ``keep - 1`` newest before it
    (see the module's docstring); returns the removed steps."""
    steps = saved_steps(root)
    kept = {step, *sorted((s for s in steps if s < step), reverse=True)[: keep - 1]}
    removed = sorted(s for s in steps if s not in kept)
    for old in removed:
        shutil.rmtree(steps[old])
    return removed
