"""An asynchronous save's host copy of a rank's state, planned once per layout.

[Note: staging plans]
What an asynchronous save copies, where each piece lands in host memory, the pieces'
records and the rank's description of the model depend only on the layout: the model's
units and their flat shards, its other parameters and buffers, the optimizer's
parameters and which state each holds, and every such tensor's address, shape and dtype.
A :class:`StagingPlan` works that out once (the state kinds' save functions, the fragment,
one host *arena* holding every piece) and is kept by the model's saver. At each save the
caller's thread only

* observes the layout (:func:`observe`): one walk over the units, the module's state dict
  and the optimizer's state, giving the plan's key and the tensors the copy reads (the
  *roots*: each unit's flat shard, every other parameter and buffer, every tensor of
  optimizer state), fetched afresh, so a tensor the optimizer replaced is read as it is now;
* compares the key (a :class:`LayoutKey`) with the plan's and builds a new plan only when it
  differs: a first save, optimizer state that appeared or changed shape, dtype or address
  (``optimizer.load_state_dict``), another optimizer, a buffer replaced;
* copies: one copy per *run* (a root's span holding its pieces, gaps under
  ``MERGE_GAP_BYTES`` included: a unit's whole flat shard in one copy, not one per
  parameter), all in one ``torch._foreach_copy_``, into views of the arena;
* takes what else must be as of the call: the generators and data position
  (``generators.snapshot_run``), the param groups' settings and optimizer state that is a
  JSON value (:meth:`StagingPlan.values_now`).

Everything else (the run record's encoding, the fragment's digest, the records, writing,
hashing) runs on the background thread. The arena is reused by the next plan when it is
large enough and pinned alike, so a save allocates nothing after the first while the layout
holds, and a new plan only after a layout change. A piece that is no view of a root (a copy
a save function made) is copied from the tensor the build saw and the plan is not reused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..assemble.root import root_of
from ..base.pages import is_file_backed, release_resident
from ..core.tensor_parallel import local_tensor
from . import fragments
from .fragments import Described, Fragment
from .kinds import TENSOR_KINDS, save_all
from .optim_state import VALUE, hyperparameters, optimizer_slots, state_kind
from .piece_records import PieceRecord, SaveContext
from .safetensors_writer import StreamItem
from .slots import ModelSlots

MERGE_GAP_BYTES = 64 << 10  # pieces of one root closer than this are copied as one run
_ALIGN = 64  # bytes; every run starts at a multiple of it in the arena


def _params_in_order(optimizer: Any) -> tuple[nn.Parameter, ...]:
    """The optimizer's parameters, group after group (what a ``ValueSite.index`` counts)."""
    return tuple(p for group in optimizer.param_groups for p in group["params"])


@dataclass(frozen=True, slots=True)
class LayoutKey:
    """What a staging plan depends on: equal keys, the same plan (ids, never the objects:
    a plan keeps no reference to the model, see :class:`StagingPlan`)."""

    root: int  # id of the model's root
    layouts: tuple[tuple[int, int], ...]  # per unit: (id of its handle, id of its layout)
    plain: tuple[tuple[str, int], ...]  # state-dict entries no unit holds: (name, id)
    optimizer: int  # id of the optimizer (id(None) without one)
    groups: tuple[tuple[int, ...], ...]  # each param group's parameters: a regrouping differs
    held: tuple[tuple[tuple[str, bool], ...], ...]  # per parameter: (state name, is tensor)
    roots: tuple[tuple, ...]  # per root: (data_ptr, dtype, shape, contiguous, device)


def observe(model: nn.Module, optimizer: Any) -> tuple[LayoutKey, list[torch.Tensor]]:
    """What a plan depends on (its key) and the tensors a staging copy reads, as of now."""
    root = root_of(model)
    handles = [u.handle for u in root.units if u.handle is not None]
    managed = {id(p) for h in handles for p in (*h.shard_params, *h.full_params)}
    roots = [h.flat_shard for h in handles]
    plain = []
    for name, tensor in root.module.state_dict(keep_vars=True).items():
        if id(tensor) not in managed:
            plain.append((name, id(tensor)))
            roots.append(local_tensor(tensor))
    params: tuple = ()
    groups: tuple = ()  # each group's parameters: a regrouping is another layout
    held: list[tuple] = []
    if optimizer is not None:
        groups = tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups)
        params = _params_in_order(optimizer)
        for param in params:
            names = []
            for name, value in (optimizer.state.get(param) or {}).items():
                is_tensor = isinstance(value, torch.Tensor)
                names.append((name, is_tensor))
                if is_tensor:
                    roots.append(local_tensor(value))
            held.append(tuple(names))
    shapes = tuple((r.data_ptr(), r.dtype, r.shape, r.is_contiguous(), r.device) for r in roots)
    layouts = tuple((id(h), id(h.layout)) for h in handles)
    key = LayoutKey(id(root), layouts, tuple(plain), id(optimizer), groups, tuple(held), shapes)
    return key, roots


@dataclass(frozen=True, slots=True)
class Run:
    """Elements ``[start, end)`` of root ``root`` (flattened), copied as one."""

    root: int  # index into the roots (past them: a piece the build copied, see the note)
    start: int
    end: int
    whole: bool  # the run is the whole root, copied as it is shaped


@dataclass(frozen=True, slots=True)
class ValueSite:
    """Optimizer state that is a JSON value (taken at every save)."""

    index: int  # the parameter's place in the optimizer's groups, in order (the key fixes it)
    state: str
    fqn: str


class StagingPlan:
    """One layout's staging: runs, the arena and its views, records, the fragment."""

    def __init__(self, key: LayoutKey) -> None:
        # Nothing here may hold the model, its modules or its parameters: the model's saver
        # keeps the plan in a weak map keyed by the model (ckpt/async_save.py), and a value
        # that reached its key would keep both alive for good.
        self.key = key  # observe()'s key when built
        self.items: list[StreamItem] = []  # one per piece, a view of the arena
        self.records: list[PieceRecord] = []  # one per item
        self.fragment = Fragment()  # groups and JSON state values set at each save
        self.value_sites: list[ValueSite] = []
        self.runs: list[Run] = []
        self.targets: list[torch.Tensor] = []  # per run: its view of the arena, root-shaped
        self.arena = torch.empty(0, dtype=torch.uint8)  # 1-D; host, pinned for accelerator roots
        self.released: list[int] = []  # roots in mapped files: dropped from memory once read
        self.unplanned: list[torch.Tensor] = []  # pieces no root holds (this build's only)
        self.reusable = True  # False when ``unplanned`` is not empty
        self.on_accelerator = False  # some root lives on an accelerator

    def fits(self, key: LayoutKey) -> bool:
        """Whether this plan stages the layout ``key`` describes."""
        return self.reusable and key == self.key

    def copy(self, roots: list[torch.Tensor]) -> None:
        """Copy the roots' runs into the arena (the staging copy)."""
        sources = roots + self.unplanned
        reads = [
            sources[r.root] if r.whole else sources[r.root].reshape(-1)[r.start : r.end]
            for r in self.runs
        ]
        if reads:
            with torch.no_grad():
                torch._foreach_copy_(self.targets, reads, non_blocking=self.on_accelerator)
        if self.on_accelerator:
            torch.accelerator.synchronize()  # the copies must land before training goes on
        for index in self.released:  # DiskOffload's mapped shards: read once, dropped
            release_resident(sources[index])
        self.unplanned = []

    def values_now(self, optimizer: Any) -> tuple[list[dict[str, Any]] | None, list[Any]]:
        """The param groups' settings and the JSON optimizer state, as of now."""
        if optimizer is None:
            return None, []
        # copied: a list or dict setting changed in place after the call is not this save's
        groups = copy.deepcopy(
            [hyperparameters(g, i) for i, g in enumerate(optimizer.param_groups)]
        )
        params = _params_in_order(optimizer)
        return groups, [optimizer.state[params[s.index]][s.state] for s in self.value_sites]

    def fragment_with(self, groups: list[dict[str, Any]] | None, values: list[Any]) -> Fragment:
        """The rank's fragment, given what :meth:`values_now` took."""
        base = self.fragment
        state = {name: dict(states) for name, states in base.state.items()}
        for site, value in zip(self.value_sites, values, strict=True):
            state[site.fqn][site.state] = Described(value=value, tensor=False)
        if groups is not None:
            assert base.groups is not None  # built with the same optimizer
            groups = [
                {**g, "params": b["params"]} for g, b in zip(groups, base.groups, strict=True)
            ]
        return Fragment(base.params, base.aliases, base.buffers, groups, state)


def build_plan(
    model: nn.Module,
    optimizer: Any,
    key: LayoutKey,
    roots: list[torch.Tensor],
    previous: StagingPlan | None,
    slots: ModelSlots,
) -> StagingPlan:
    """A plan for the layout ``key`` (its roots ``roots``, the model's ``slots``), reusing
    ``previous``'s arena when it is large enough."""
    plan = StagingPlan(key)
    saved = save_all(SaveContext("", slots, optimizer, None), TENSOR_KINDS)
    assert not saved.files and not saved.meta  # the tensor kinds contribute pieces only
    plan.records = saved.records
    plan.fragment = fragments.fragment(slots, optimizer)
    if optimizer is not None:
        order = {id(p): i for i, p in enumerate(_params_in_order(optimizer))}
        for slot in (s for group in optimizer_slots(optimizer, slots) for s in group):
            for state, value in optimizer.state.get(slot.local, {}).items():
                if state_kind(slot, state, value) == VALUE:
                    plan.value_sites.append(ValueSite(order[id(slot.local)], state, slot.fqn))
    pieces = [item.produce().detach() for item in saved.items]
    spans = _place(plan, roots, pieces)
    offsets, total = [], 0
    for run in plan.runs:
        offsets.append(total)
        total += -(-_run_bytes(run, roots + plan.unplanned) // _ALIGN) * _ALIGN
    plan.on_accelerator = any(r.device.type != "cpu" for r in roots + plan.unplanned)
    plan.arena = _arena(previous, total, plan.on_accelerator)
    plan.released = sorted({r.root for r in plan.runs if r.root < len(roots)} & _mapped(roots))
    sources = roots + plan.unplanned
    for run, offset in zip(plan.runs, offsets, strict=True):
        root = sources[run.root]
        view = plan.arena[offset : offset + _run_bytes(run, sources)].view(root.dtype)
        plan.targets.append(view.view(root.shape) if run.whole else view)
    for item, piece, (run_index, start) in zip(saved.items, pieces, spans, strict=True):
        view = _piece_view(plan, offsets, run_index, start, piece)
        plan.items.append(StreamItem(item.key, item.dtype, item.shape, lambda v=view: v))
    return plan


def _place(plan: StagingPlan, roots: list[torch.Tensor], pieces: list[torch.Tensor]) -> list:
    """Group the pieces into runs (``plan.runs``); each piece's ``(run, element start)``."""
    where = [_root_of(roots, piece) for piece in pieces]
    for index, piece in enumerate(pieces):
        if where[index] is None and piece.numel():  # no root holds it: copy it as it is
            plan.unplanned.append(piece.reshape(-1))
            where[index] = (len(roots) + len(plan.unplanned) - 1, 0)
            plan.reusable = False
    by_root: dict[int, list[tuple[int, int]]] = {}
    for found, piece in zip(where, pieces, strict=True):
        if found is not None and piece.numel():
            by_root.setdefault(found[0], []).append((found[1], found[1] + piece.numel()))
    sources = roots + plan.unplanned
    run_of: dict[tuple[int, int], int] = {}  # (root, element) of a piece's start -> run
    for root_index in sorted(by_root):
        gap = MERGE_GAP_BYTES // sources[root_index].element_size()
        spans = sorted(by_root[root_index])
        lo, hi, members = spans[0][0], spans[0][1], []
        for start, end in spans + [(None, None)]:
            if start is not None and start - hi <= gap:
                hi, members = max(hi, end), members + [start]
                continue
            whole = lo == 0 and hi == sources[root_index].numel()
            plan.runs.append(Run(root_index, lo, hi, whole))
            run_of.update({(root_index, m): len(plan.runs) - 1 for m in members})
            if start is not None:
                lo, hi, members = start, end, [start]
    return [
        (-1, 0) if found is None or not piece.numel() else (run_of[found], found[1])
        for found, piece in zip(where, pieces, strict=True)
    ]


def _root_of(roots: list[torch.Tensor], piece: torch.Tensor) -> tuple[int, int] | None:
    """``(root index, element offset)`` of the root ``piece`` is a contiguous view of."""
    if not piece.numel() or not piece.is_contiguous():
        return None
    storage, size = piece.untyped_storage().data_ptr(), piece.element_size()
    for index, root in enumerate(roots):
        if root.dtype != piece.dtype or not root.is_contiguous():
            continue
        if root.untyped_storage().data_ptr() != storage or root.device != piece.device:
            continue
        offset, remainder = divmod(piece.data_ptr() - root.data_ptr(), size)
        if not remainder and 0 <= offset and offset + piece.numel() <= root.numel():
            return index, offset
    return None


def _run_bytes(run: Run, sources: list[torch.Tensor]) -> int:
    return (run.end - run.start) * sources[run.root].element_size()


def _piece_view(
    plan: StagingPlan, offsets: list[int], run_index: int, start: int, piece: torch.Tensor
) -> torch.Tensor:
    """Where ``piece`` lands in the arena, 1-D (empty pieces: an empty view)."""
    if run_index < 0:
        return plan.arena[:0].view(piece.dtype)
    run = plan.runs[run_index]
    first = offsets[run_index] + (start - run.start) * piece.element_size()
    return plan.arena[first : first + piece.numel() * piece.element_size()].view(piece.dtype)


def _arena(previous: StagingPlan | None, num_bytes: int, pinned: bool) -> torch.Tensor:
    """``previous``'s arena if it holds ``num_bytes`` and is pinned alike; else a new one."""
    if previous is not None and previous.arena.numel() >= num_bytes:
        if previous.arena.is_pinned() == pinned:
            return previous.arena
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)


def _mapped(roots: list[torch.Tensor]) -> set[int]:
    return {i for i, root in enumerate(roots) if is_file_backed(root)}
