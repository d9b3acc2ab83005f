"""One rank's part of ``load_checkpoint``: everything checked first, then the copy.

[Note: a refused load changes nothing]
``load_checkpoint`` runs two steps, each settled across ranks (ckpt/outcome.py: a 4-byte
all-reduce of whether any rank failed) before the next starts:

1. *check*: the index against the model and the optimizer (names, shapes, dtypes,
   settings), the run files, and every range this rank will copy (:func:`planned_reads`),
   verified by the reader as its copy would verify it: files listed, inside the folder,
   present at their size, keys, dtypes and lengths from the files' headers, and the
   checksums of every chunk ([Note: checked before read] in reader.py). Each chunk is
   read to be hashed and dropped; nothing is staged, so memory does not grow with the
   rank's share. The sampler takes its saved position on trial, put back if any rank
   fails (a sampler without ``state_dict()`` cannot be put back: it is set in step 2).
2. *copy*: the planned reads into the model and the optimizer, from the sealed reader
   (a read outside the plan raises rather than copying unchecked data).

So a checkpoint that any rank refuses leaves every rank's model, optimizer, sampler and
random streams (restored only after step 2) as they were. Not covered: a file another
process changes between the two steps (its chunks count as verified).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from ..base.validate import check_bool
from .format import CheckpointError, CheckpointIndex, TensorEntry, read_index
from .matching import check_entry, check_fits_model, match_names
from .optim_state import build_load_dict, check_fits, optimizer_slots
from .reader import CheckpointReader
from .run_state import RunRestore, check_sampler, read_for_load
from .slots import ModelSlots, ParamSlot


class PlannedRead(NamedTuple):
    """Elements ``[start, end)`` of a saved tensor that a rank copies."""

    name: str  # the saved name (``<parameter>/<state>`` for optimizer state)
    entry: TensorEntry
    start: int
    end: int


class Loading:
    """One rank's load of one checkpoint (see [Note: a refused load changes nothing])."""

    def __init__(
        self,
        root: str,
        slots: ModelSlots,
        optimizer: torch.optim.Optimizer | None,
        *,
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
        self.index: CheckpointIndex | None = None
        self.run: RunRestore | None = None  # what restores the random streams, after step 2
        self._matched: list[tuple[ParamSlot, str]] = []
        self._reader: CheckpointReader | None = None
        self._data: Any = None  # the sampler's saved position
        self._sampler_before: Any = None  # its state before the trial, to put back

    def check(self) -> dict[str, Any]:
        """Step 1: raise unless the copy would succeed; change only the sampler, on trial."""
        comm = self.slots.world_comm
        check_sampler("sampler", self.sampler, "load_state_dict")
        check_bool("restore_rng", self.restore_rng)
        index = self.index = read_index(self.root)
        self._matched = match_names(index, self.slots, self.strict, self.elsewhere)
        check_fits_model(
            index, self.slots, self._matched, with_optimizer=self.optimizer is not None
        )
        if self.optimizer is not None:
            check_optimizer(index, self.slots, self.optimizer, self.elsewhere)
        if self.restore_rng or self.sampler is not None:
            run, self._data = read_for_load(
                self.root, index.meta, comm.rank, comm.size, self.sampler
            )
            self.run = run if self.restore_rng else None
        self._reader = CheckpointReader(self.root, index)
        for read in planned_reads(index, self.slots, self._matched, self.optimizer, self.elsewhere):
            self._reader.verify_range(*read)
        self._reader.seal()
        if self.sampler is not None and callable(getattr(self.sampler, "state_dict", None)):
            self._sampler_before = self.sampler.state_dict()
            self.sampler.load_state_dict(self._data)
        return {}

    def undo_trial(self) -> None:
        """After a failed step 1 on any rank: put the sampler back."""
        if self._sampler_before is not None:
            self.sampler.load_state_dict(self._sampler_before)

    def copy(self) -> dict[str, Any]:
        """Step 2: the planned reads into the model and the optimizer."""
        if self.sampler is not None and self._sampler_before is None:
            self.sampler.load_state_dict(self._data)
        assert self.index is not None and self._reader is not None  # step 1 succeeded
        load_params(self.index, self._reader, self.slots, self._matched)
        if self.optimizer is not None:
            load_optimizer(self.index, self._reader, self.slots, self.optimizer, self.elsewhere)
        return {}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


def planned_reads(
    index: CheckpointIndex,
    slots: ModelSlots,
    matched: list[tuple[ParamSlot, str]],
    optimizer: torch.optim.Optimizer | None,
    elsewhere: set[str],
) -> list[PlannedRead]:
    """Every range :func:`load_params` and :func:`load_optimizer` read, in their order."""
    reads = []
    for slot, saved_name in matched:
        if slot.end > slot.start:
            entry = index.params[saved_name]
            reads += [PlannedRead(saved_name, entry, s, e) for s, e in slot.global_ranges()]
    for name in slots.buffers:
        entry = index.buffers.get(name)
        if entry is not None:
            reads.append(PlannedRead(name, entry, 0, entry.numel))
    if optimizer is None:
        return reads
    saved_state = {index.resolve(k): v for k, v in (index.optim_state or {}).items()}
    for slot in (s for group in optimizer_slots(optimizer, slots) for s in group):
        for state, entry in saved_state.get(slot.fqn, {}).items():
            name = f"{slot.fqn}/{state}"
            if not isinstance(entry, TensorEntry):
                continue
            if entry.shape == ():
                reads.append(PlannedRead(name, entry, 0, entry.numel))
                continue
            check_entry(name, entry, slot.shape, slot.dtype)
            reads += [PlannedRead(name, entry, s, e) for s, e in slot.global_ranges()]
    return reads


def load_params(
    index: CheckpointIndex, reader: CheckpointReader, slots: ModelSlots, matched: list
) -> None:
    with torch.no_grad():
        for slot, saved_name in matched:
            entry = index.params[saved_name]
            if slot.end > slot.start:
                read = functools.partial(reader.read_range, saved_name, entry)
                slot.local_flat().copy_(slot.read_local(read))
        for name, buffer in slots.buffers.items():
            entry = index.buffers.get(name)
            if entry is None:
                continue  # reported by match_names under strict
            buffer.copy_(reader.read_full(name, entry))


def saved_groups(index: CheckpointIndex, elsewhere: set[str]) -> list[dict[str, Any]]:
    """The saved param groups, less the parameters of other pipeline stages."""
    if index.optim_state is None or index.param_groups is None:
        raise CheckpointError("the checkpoint holds no optimizer state (saved without optimizer)")
    return [
        {**g, "params": [index.resolve(n) for n in g["params"] if n not in elsewhere]}
        for g in index.param_groups
    ]


def check_optimizer(index: CheckpointIndex, slots: ModelSlots, optimizer, elsewhere) -> None:
    saved_class = index.meta.get("optimizer_class")
    saved = saved_groups(index, elsewhere)
    check_fits(optimizer, optimizer_slots(optimizer, slots), saved_class, saved)


def load_optimizer(
    index: CheckpointIndex,
    reader: CheckpointReader,
    slots: ModelSlots,
    optimizer: torch.optim.Optimizer,
    elsewhere: set[str],
) -> None:
    groups = saved_groups(index, elsewhere)
    saved_state = {index.resolve(k): v for k, v in (index.optim_state or {}).items()}
    names = {n: list(states) for n, states in saved_state.items()}

    def read(slot: ParamSlot, state: str) -> Any:
        entry = saved_state[slot.fqn][state]
        if isinstance(entry, dict):
            return entry["value"]
        if entry.shape == ():
            return reader.read_full(f"{slot.fqn}/{state}", entry)
        flat = slot.read_local(lambda s, e: reader.read_range(f"{slot.fqn}/{state}", entry, s, e))
        return flat.reshape(slot.local.shape)

    groups_slots = optimizer_slots(optimizer, slots)
    optimizer.load_state_dict(build_load_dict(optimizer, groups_slots, groups, names, read))
