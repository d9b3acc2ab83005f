"""Each state kind's save and load: the table a checkpoint runs over ([Note: state kinds]).

``save_checkpoint`` calls every kind's save function on every rank and adds up what they
contribute (ckpt/save.py); ``load_checkpoint`` makes every kind's :class:`KindLoad` and
runs their checks, then their copies (ckpt/loading.py). The model's parameters, buffers
and optimizer state are here; the run state is in ckpt/run_state.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .format import CheckpointError, TensorEntry, dtype_name
from .matching import check_entry
from .optim_state import SCALAR, SHARDED, build_load_dict, check_fits, optimizer_slots, state_kind
from .piece_records import (
    KindLoad,
    LoadContext,
    PieceRecord,
    PlannedRead,
    SaveContext,
    Saved,
    StateKind,
)
from .run_state import RunLoad, save_run, take_run
from .safetensors_writer import StreamItem
from .slots import ParamSlot, shaped_like


def _add(saved: Saved, record: PieceRecord, value: torch.Tensor) -> None:
    flat = value.detach().reshape(-1)
    saved.items.append(StreamItem(record.key, flat.dtype, (flat.numel(),), lambda flat=flat: flat))
    saved.records.append(record)


def _piece(kind: StateKind, name: str, state: str | None, value: torch.Tensor) -> PieceRecord:
    """A whole tensor's piece, outside any run."""
    return PieceRecord(kind, name, state, 0, value.numel(), dtype_name(value.dtype))


def _add_slot(
    saved: Saved, kind: StateKind, slot: ParamSlot, state: str | None, value: torch.Tensor
) -> None:
    """The pieces of ``slot``'s range of ``value`` (several for a tensor-parallel block)."""
    step, origin = _run_pattern(slot)
    for at, piece, start in slot.saved_pieces(value):
        dtype = dtype_name(piece.dtype)
        end = start + piece.numel()
        _add(saved, PieceRecord(kind, slot.fqn, state, start, end, dtype, step, origin, at), piece)


def _run_pattern(slot: ParamSlot) -> tuple[int, int]:
    """``(step, origin)`` of a sharded slot's piece ([Note: piece runs]); ``(0, 0)`` for
    the rest, tensor-parallel blocks included (their pieces are listed)."""
    handle = slot.handle
    if handle is None or handle.num_shards == 1 or slot.tp is not None:
        return 0, 0
    step = handle.layout.shard_numel
    return step, handle.shard_comm.rank * step - handle.layout.params[slot.index].offset


# ------------------------------------------------------------------------- saves
def save_params(ctx: SaveContext) -> Saved:
    """This rank's ranges of the parameters it owns ([Note: checkpoint layout])."""
    saved = Saved()
    for slot in ctx.slots.slots:
        if slot.saves and slot.end > slot.start:
            _add_slot(saved, StateKind.PARAM, slot, None, slot.local)
    return saved


def save_buffers(ctx: SaveContext) -> Saved:
    """Whole buffers, from the first data-parallel rank of each stage."""
    saved = Saved()
    if ctx.slots.leads:
        for name, buffer in ctx.slots.buffers.items():
            _add(saved, _piece(StateKind.BUFFER, name, None, buffer), buffer)
    return saved


def save_optim(ctx: SaveContext) -> Saved:
    """This rank's ranges of sharded optimizer state; scalar state from a stage's lead.
    (JSON values of the state go into the index from rank 0's fragment.)"""
    saved, optimizer = Saved(), ctx.optimizer
    if optimizer is None:
        return saved
    for slot in (s for group in optimizer_slots(optimizer, ctx.slots) for s in group):
        for state, value in optimizer.state.get(slot.local, {}).items():
            kind = state_kind(slot, state, value)
            if kind == SHARDED and slot.saves and slot.end > slot.start:
                _add_slot(saved, StateKind.OPTIM, slot, state, value)
            elif kind == SCALAR and ctx.slots.leads:
                _add(saved, _piece(StateKind.OPTIM, slot.fqn, state, value), value)
    return saved


# ------------------------------------------------------------------------- loads
class ParamLoad(KindLoad):
    """The ranges of the saved parameters this rank holds (names matched by the loader)."""

    def check(self, ctx: LoadContext) -> list[PlannedRead]:
        reads = []
        for slot, saved_name in ctx.matched:
            if slot.end > slot.start:
                entry = ctx.index.params[saved_name]
                reads += [PlannedRead(saved_name, entry, s, e) for s, e in slot.global_ranges()]
        return reads

    def copy(self, ctx: LoadContext) -> None:
        with torch.no_grad():
            for slot, saved_name in ctx.matched:
                if slot.end > slot.start:
                    read = functools.partial(
                        ctx.reader.read_range, saved_name, ctx.index.params[saved_name]
                    )
                    slot.local_flat().copy_(slot.read_local(read))


class BufferLoad(KindLoad):
    """Whole buffers (one missing under ``strict`` is refused by the name check)."""

    def check(self, ctx: LoadContext) -> list[PlannedRead]:
        entries = ((n, ctx.index.buffers.get(n)) for n in ctx.slots.buffers)
        return [PlannedRead(n, e, 0, e.numel) for n, e in entries if e is not None]

    def copy(self, ctx: LoadContext) -> None:
        with torch.no_grad():
            for name, buffer in ctx.slots.buffers.items():
                entry = ctx.index.buffers.get(name)
                if entry is not None:
                    buffer.copy_(ctx.reader.read_full(name, entry))


class OptimLoad(KindLoad):
    """The optimizer's settings and this rank's share of its saved state."""

    def check(self, ctx: LoadContext) -> list[PlannedRead]:
        if ctx.optimizer is None:
            return []
        saved_class = ctx.index.meta.get("optimizer_class")
        groups_slots = optimizer_slots(ctx.optimizer, ctx.slots)
        check_fits(ctx.optimizer, groups_slots, saved_class, saved_groups(ctx))
        reads = []
        for slot in (s for group in groups_slots for s in group):
            for state, entry in _saved_state(ctx).get(slot.fqn, {}).items():
                name = f"{slot.fqn}/{state}"
                if not isinstance(entry, TensorEntry):
                    continue
                if entry.shape == ():
                    reads.append(PlannedRead(name, entry, 0, entry.numel))
                    continue
                check_entry(name, entry, slot.shape, slot.dtype)
                reads += [PlannedRead(name, entry, s, e) for s, e in slot.global_ranges()]
        return reads

    def copy(self, ctx: LoadContext) -> None:
        if ctx.optimizer is None:
            return
        saved_state = _saved_state(ctx)
        names = {n: list(states) for n, states in saved_state.items()}

        def read(slot: ParamSlot, state: str) -> Any:
            entry = saved_state[slot.fqn][state]
            name = f"{slot.fqn}/{state}"
            if isinstance(entry, dict):
                return entry["value"]
            if entry.shape == ():
                return ctx.reader.read_full(name, entry)
            flat = slot.read_local(lambda s, e: ctx.reader.read_range(name, entry, s, e))
            return shaped_like(slot.local, flat)

        groups_slots = optimizer_slots(ctx.optimizer, ctx.slots)
        loaded = build_load_dict(ctx.optimizer, groups_slots, saved_groups(ctx), names, read)
        ctx.optimizer.load_state_dict(loaded)


def _saved_state(ctx: LoadContext) -> dict[str, dict[str, Any]]:
    return {ctx.index.resolve(k): v for k, v in (ctx.index.optim_state or {}).items()}


def saved_groups(ctx: LoadContext) -> list[dict[str, Any]]:
    """The saved param groups, less the parameters of other pipeline stages."""
    index = ctx.index
    if index.optim_state is None or index.param_groups is None:
        raise CheckpointError("the checkpoint holds no optimizer state (saved without optimizer)")
    return [
        {**g, "params": [index.resolve(n) for n in g["params"] if n not in ctx.elsewhere]}
        for g in index.param_groups
    ]


# ------------------------------------------------------------------------- table
@dataclass(frozen=True, slots=True)
class KindIO:
    """A state kind's save function and the class of its part of a load.

    ``take``: for a kind an asynchronous save does not stage through its plan (not in
    ``TENSOR_KINDS``), what the save takes on the caller's thread: called with the
    context (no save id yet), it takes what must be as of the call and returns the
    function that makes the kind's contribution once the save id is known (on the
    background thread).
    """

    save: Callable[[SaveContext], Saved]
    load: type[KindLoad]
    take: Callable[[SaveContext], Callable[[str], Saved]] | None = None


KINDS: dict[StateKind, KindIO] = {
    StateKind.PARAM: KindIO(save_params, ParamLoad),
    StateKind.BUFFER: KindIO(save_buffers, BufferLoad),
    StateKind.OPTIM: KindIO(save_optim, OptimLoad),
    StateKind.RUN: KindIO(save_run, RunLoad, take_run),
}
# The kinds whose pieces are tensors: an asynchronous save plans their host copy once per
# layout ([Note: staging plans] in staging_plan.py); the others are taken at every save.
TENSOR_KINDS = (StateKind.PARAM, StateKind.BUFFER, StateKind.OPTIM)
TAKEN_KINDS = tuple(kind for kind in StateKind if kind not in TENSOR_KINDS)


def save_all(ctx: SaveContext, kinds: tuple[StateKind, ...] = tuple(StateKind)) -> Saved:
    """What every state kind (of ``kinds``) saves on this rank, in the enum's order."""
    saved = Saved()
    for kind in kinds:
        saved.add(KINDS[kind].save(ctx))
    return saved


def take_all(ctx: SaveContext, kinds: tuple[StateKind, ...] = TAKEN_KINDS):
    """Each of ``kinds`` takes its state as of now (``KindIO.take``); the function that
    adds up their contributions, in the enum's order, once given the save id."""
    taken = []
    for kind in kinds:
        take = KINDS[kind].take
        if take is None:
            raise RuntimeError(
                f"state kind {kind.value!r} has no take function for an asynchronous save"
            )
        taken.append(take(ctx))

    def contributions(save_id: str) -> Saved:
        saved = Saved()
        for finish in taken:
            saved.add(finish(save_id))
        return saved

    return contributions
