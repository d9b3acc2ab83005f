"""``load_checkpoint``: every rank checks everything first, then copies.

[Note: a refused load changes nothing]
``load_checkpoint`` runs two steps, each settled across ranks (ckpt/outcome.py: a 4-byte
all-reduce of whether any rank failed) before the next starts:

1. *check*: the index against the model (names, shapes, dtypes), then every state kind's
   check ([Note: state kinds] in piece_records.py: the optimizer's settings, the run files) and
   every range this rank will copy, verified by the reader as its copy would verify it:
   files listed, inside the folder, present at their size, keys, dtypes and lengths from
   the files' headers, and the checksums of every chunk ([Note: checked before read] in
   reader.py). Each chunk is read to be hashed and dropped; nothing is staged, so memory
   does not grow with the rank's share. Then each kind's trial: the sampler takes its
   saved position, put back if any rank fails (a sampler without ``state_dict()`` cannot
   be put back: it is set in step 2).
2. *copy*: every kind's copy, from the sealed reader (a read outside the plan raises
   rather than copying unchecked data).

So a checkpoint that any rank refuses leaves every rank's model, optimizer, sampler and
random streams (restored only after step 2, by the run state's ``finish``) as they were.
Not covered: a file another process changes between the two steps (its chunks count as
verified).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..base.validate import check_bool
from . import fragments
from .format import read_index
from .kinds import KINDS
from .matching import check_fits_model, match_names
from .outcome import guarded, settle
from .piece_records import KindLoad, LoadContext, StateKind
from .reader import CheckpointReader
from .run_state import META_KEY, check_sampler, run_file_name
from .slots import ModelSlots, model_slots


def load_checkpoint(
    path: str | os.PathLike,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    sampler: Any = None,
    restore_rng: bool = True,
) -> Any:
    """Load a checkpoint saved at any world size and strategy; returns its ``extra``.

    Call on every rank. With ``strict``, parameters or buffers present on only one side
    are an error; without it they are skipped. ``sampler.load_state_dict`` gets the saved
    data position; with ``restore_rng`` every rank's random number generators continue
    where they were saved ([Note: run state files]; nothing for a checkpoint without them).
    """
    root = os.fspath(path)
    slots = model_slots(model)
    comm = slots.world_comm
    # Other pipeline stages' names ([Note: checkpoints of pipeline stages]).
    elsewhere = fragments.names_held_elsewhere(slots, [fragments.every_name(slots)])
    loading = Loading(root, slots, optimizer, strict, sampler, restore_rng, elsewhere)
    # Every rank checks all it will read before any rank changes anything, so a checkpoint
    # that one rank refuses leaves every rank as it was ([Note: a refused load changes
    # nothing]).
    try:
        settle(comm, "load", root, guarded(loading.check).error, loading.undo_trial)
        settle(comm, "load", root, guarded(loading.copy).error)
    finally:
        loading.close()
    return loading.finish()


def files_to_read(
    root: str, slots: ModelSlots, optimizer: torch.optim.Optimizer | None, *, strict: bool = True
) -> set[str]:
    """The files of checkpoint ``root`` that this rank's load would open: those of the
    pieces its parameters, buffers and optimizer state overlap (read from the index
    alone), and its own and rank 0's run files. Collective (the names of other stages)."""
    elsewhere = fragments.names_held_elsewhere(slots, [fragments.every_name(slots)])
    index = read_index(root)  # after the collective: a rank that fails here hangs no one
    matched = match_names(index, slots, strict, elsewhere)
    reader = CheckpointReader(root, index)  # opens nothing until a read
    ctx = LoadContext(root, index, reader, slots, optimizer, None, False, elsewhere, matched)
    files = set()
    for kind in (StateKind.PARAM, StateKind.BUFFER, StateKind.OPTIM):
        for read in KINDS[kind].load().check(ctx):
            files.update(piece.file for piece in read.entry.overlapping(read.start, read.end))
    if index.meta.get(META_KEY) is not None:
        save_id, rank = str(index.meta.get("save_id")), slots.world_comm.rank
        files.add(run_file_name(save_id, 0))
        if rank < int(index.meta.get("world_size", 0)):
            files.add(run_file_name(save_id, rank))
    return files


class Loading:
    """One rank's load of one checkpoint (see [Note: a refused load changes nothing])."""

    def __init__(
        self,
        root: str,
        slots: ModelSlots,
        optimizer: torch.optim.Optimizer | None,
        strict: bool,
        sampler: Any,
        restore_rng: bool,
        elsewhere: set[str],
    ) -> None:
        self.root = root
        self.slots = slots
        self.optimizer = optimizer
        self.strict = strict
        self.sampler = sampler
        self.restore_rng = restore_rng
        self.elsewhere = elsewhere  # other pipeline stages' names
        self.ctx: LoadContext | None = None  # once the index is read
        self.parts: dict[StateKind, KindLoad] = {kind: KINDS[kind].load() for kind in StateKind}

    def check(self) -> None:
        """Step 1: raise unless the copy would succeed; change only what undo puts back."""
        check_sampler("sampler", self.sampler, "load_state_dict")
        check_bool("restore_rng", self.restore_rng)
        index = read_index(self.root)
        matched = match_names(index, self.slots, self.strict, self.elsewhere)
        with_optimizer = self.optimizer is not None
        check_fits_model(index, self.slots, matched, with_optimizer=with_optimizer)
        ctx = self.ctx = LoadContext(
            self.root,
            index,
            CheckpointReader(self.root, index),
            self.slots,
            self.optimizer,
            self.sampler,
            self.restore_rng,
            self.elsewhere,
            matched,
        )
        reads = [read for part in self.parts.values() for read in part.check(ctx)]
        for read in reads:
            ctx.reader.verify_range(read.name, read.entry, read.start, read.end)
        ctx.reader.seal()
        for part in self.parts.values():
            part.trial(ctx)

    def undo_trial(self) -> None:
        """After a failed step 1 on any rank: put back what the trials set."""
        if self.ctx is not None:
            for part in self.parts.values():
                part.undo(self.ctx)

    def copy(self) -> None:
        """Step 2: every kind's copy."""
        assert self.ctx is not None  # step 1 succeeded
        for part in self.parts.values():
            part.copy(self.ctx)

    def finish(self) -> Any:
        """After every rank copied: what comes last; the checkpoint's ``extra``."""
        assert self.ctx is not None
        for part in self.parts.values():
            part.finish(self.ctx)
        return self.ctx.index.extra

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.reader.close()
