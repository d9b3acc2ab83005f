"""What each rank's model contributes to a checkpoint's index, and their union.

[Note: checkpoints of pipeline stages]
Under pipeline parallelism each rank's ``ShardedModule`` holds one stage: a part of the
whole model, under the whole model's names (the stage module keeps them, as torchtitan's
stages do). A checkpoint must still describe the whole model, so every rank reports a
*fragment*: the names, shapes and dtypes of its parameters, buffers and optimizer state
and its optimizer's parameter groups. World rank 0 writes the index from the union of
the fragments (under plain data parallelism every fragment is the same). Full-shape
tensors under the whole model's names load under plain data parallelism at any world
size, into other stage splits, or into ``from_pretrained``, and the reverse.

Loading checks names against the union of every rank's names, so a stage does not find
the other stages' tensors "unexpected"; its optimizer loads its own share of each saved
parameter group. Buffers, parameters outside every unit and scalar optimizer state are
written by each stage's first data-parallel rank.

[Note: replicas the model cannot see]
Ranks can hold identical copies that nothing in their own model tells apart: under
TP x PP x DP, a stage with no tensor-parallel parameter (an embedding-only first stage)
is computed alike by every TP rank, each wrapped over its own data-parallel group, so
each leads its group and saves the same ranges (the TP rule, mesh coordinate 0, needs a
``DTensor`` to read the mesh from). Rank 0 keeps the pieces of the lowest such rank and
drops the others' reports whole (:func:`without_replicas`), so the index lists each range
once and the replicas' files are removed with the stale ones. The cost: those replicas
write their copy before it is dropped. Tensor-parallel models are not affected: their TP
replicas save nothing twice.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ..comm.json_values import broadcast_json, gather_json
from .format import CheckpointError, dtype_name
from .optim_state import SHARDED, VALUE, hyperparameters, optimizer_slots, state_kind
from .piece_records import RankReport, SentFragment
from .slots import ModelSlots


@dataclass(frozen=True, slots=True)
class Described:
    """A saved tensor's whole shape and dtype; or, for optimizer state that is no tensor
    (``tensor`` false), its JSON ``value``."""

    shape: tuple[int, ...] = ()
    dtype: str = ""
    value: Any = None
    tensor: bool = True

    def to_json(self) -> Any:
        if not self.tensor:
            return {"value": self.value}
        return [list(self.shape), self.dtype]

    @staticmethod
    def from_json(raw: Any) -> Described:
        if isinstance(raw, dict):
            return Described(value=raw["value"], tensor=False)
        shape, dtype = raw
        return Described(tuple(int(d) for d in shape), str(dtype))

    def __str__(self) -> str:
        return f"{list(self.shape)} {self.dtype}" if self.tensor else f"value {self.value!r}"


@dataclass(slots=True)
class Fragment:
    """One rank's part of the index (see [Note: checkpoints of pipeline stages]); also the
    union of every rank's (:func:`merge`)."""

    params: dict[str, Described] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> canonical name
    buffers: dict[str, Described] = field(default_factory=dict)
    groups: list[dict[str, Any]] | None = None  # hyperparameters + "params": [names]
    state: dict[str, dict[str, Described]] = field(default_factory=dict)  # param -> state

    def to_json(self) -> dict[str, Any]:
        return {
            "params": {n: d.to_json() for n, d in self.params.items()},
            "aliases": dict(self.aliases),
            "buffers": {n: d.to_json() for n, d in self.buffers.items()},
            "groups": self.groups,
            "state": {
                n: {k: d.to_json() for k, d in states.items()} for n, states in self.state.items()
            },
        }

    @staticmethod
    def from_json(raw: Any) -> Fragment:
        def described(section: Any) -> dict[str, Described]:
            return {str(n): Described.from_json(d) for n, d in section.items()}

        try:
            return Fragment(
                described(raw["params"]),
                {str(k): str(v) for k, v in raw["aliases"].items()},
                described(raw["buffers"]),
                None if raw["groups"] is None else list(raw["groups"]),
                {str(n): described(states) for n, states in raw["state"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"a rank's model description is malformed: {exc!r}") from exc


def fragment(slots: ModelSlots, optimizer: Any) -> Fragment:
    """This rank's part of the index (see [Note: checkpoints of pipeline stages])."""
    result = Fragment(
        params={s.fqn: Described(tuple(s.shape), dtype_name(s.dtype)) for s in slots.slots},
        aliases=dict(slots.aliases),
        buffers={
            n: Described(tuple(b.shape), dtype_name(b.dtype)) for n, b in slots.buffers.items()
        },
    )
    if optimizer is None:
        return result
    groups = []
    for index, (group, group_slots) in enumerate(
        zip(optimizer.param_groups, optimizer_slots(optimizer, slots), strict=True)
    ):
        groups.append({**hyperparameters(group, index), "params": [s.fqn for s in group_slots]})
        for slot in group_slots:
            for state, value in optimizer.state.get(slot.local, {}).items():
                kind = state_kind(slot, state, value)
                if kind == VALUE:
                    entry = Described(value=value, tensor=False)
                else:
                    shape = tuple(slot.shape) if kind == SHARDED else ()
                    entry = Described(shape, dtype_name(value.dtype))
                result.state.setdefault(slot.fqn, {})[state] = entry
    result.groups = groups
    return result


def to_send(slots: ModelSlots, part: Fragment) -> SentFragment:
    """What a rank sends rank 0 of its fragment: the whole of it from the first
    data-parallel rank of each stage, only its digest from the others (whose fragment is
    their stage's: sending it whole made rank 0 receive the model's description once per
    rank)."""
    raw = part.to_json()
    text = json.dumps(raw, sort_keys=True, default=repr)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return SentFragment(digest, raw if slots.leads else None)


def received(sent: list[SentFragment]) -> list[Fragment]:
    """The leading ranks' fragments, once every other rank's digest matches one of them."""
    known = {s.digest for s in sent if s.fragment is not None}
    for rank, part in enumerate(sent):
        if part.digest not in known:
            raise CheckpointError(
                f"rank {rank}: its model or optimizer (names, shapes, dtypes, param groups) "
                "differs from that of the first data-parallel rank of every stage; every rank "
                "must hold the same model (or disjoint pipeline stages of it)"
            )
    return [Fragment.from_json(s.fragment) for s in sent if s.fragment is not None]


def merge(fragments: list[Fragment]) -> Fragment:
    """The union of every rank's fragment; a name two ranks describe differently is an error."""
    merged = Fragment()
    for rank, part in enumerate(fragments):
        _union(merged.params, part.params, "params", rank)
        _union(merged.aliases, part.aliases, "aliases", rank)
        _union(merged.buffers, part.buffers, "buffers", rank)
        for name, states in part.state.items():
            _union(merged.state.setdefault(name, {}), states, f"optimizer state of {name}", rank)
    with_optim = [(rank, p.groups) for rank, p in enumerate(fragments) if p.groups]
    merged.groups = _merge_groups(with_optim) if with_optim else None
    if merged.groups is not None and len(with_optim) != len(fragments):
        raise CheckpointError("an optimizer was given on some ranks and not on others")
    return merged


def _union(into: dict, part: dict, what: str, rank: int) -> None:
    for name, value in part.items():
        if into.setdefault(name, value) != value:
            raise CheckpointError(
                f"{what} {name!r}: rank {rank} has {value}, an earlier rank {into[name]}; "
                "every rank must hold the same model (or disjoint pipeline stages of it)"
            )


def _merge_groups(with_optim: list[tuple[int, list[dict]]]) -> list[dict[str, Any]]:
    first_rank, first = with_optim[0]
    merged = [{**g, "params": list(g["params"])} for g in first]
    for rank, groups in with_optim[1:]:
        if len(groups) != len(merged):
            raise CheckpointError(
                f"optimizer: rank {rank} has {len(groups)} param groups, rank {first_rank} "
                f"{len(merged)}; every stage's optimizer needs the same groups"
            )
        for index, (into, group) in enumerate(zip(merged, groups, strict=True)):
            settings = {k: v for k, v in group.items() if k != "params"}
            if settings != {k: v for k, v in into.items() if k != "params"}:
                raise CheckpointError(
                    f"optimizer: param_groups[{index}] settings differ between rank "
                    f"{first_rank} and rank {rank}"
                )
            into["params"] += [n for n in group["params"] if n not in into["params"]]
    return merged


def names_held_elsewhere(slots: ModelSlots, every_rank_names: list[list[str]]) -> set[str]:
    """Parameter and buffer names other ranks' models hold and this one does not (the
    other pipeline stages'; empty under plain data parallelism)."""
    mine = {s.fqn for s in slots.slots} | set(slots.aliases) | set(slots.buffers)
    return {n for names in every_rank_names for n in names} - mine


def every_name(slots: ModelSlots) -> list[str]:
    """The union of every rank's names: gathered to rank 0, merged, sent back once, as
    JSON ([Note: no pickle between ranks] in comm/json_values.py).

    (An all-gather of each rank's names made every rank receive them once per rank.)
    """
    comm = slots.world_comm
    gathered = gather_json(comm, local_names(slots), purpose="checkpoint_names")
    union = sorted({n for names in gathered for n in names}) if gathered is not None else None
    return broadcast_json(comm, union, purpose="checkpoint_names")


def local_names(slots: ModelSlots) -> list[str]:
    return sorted({s.fqn for s in slots.slots} | set(slots.aliases) | set(slots.buffers))


def without_replicas(reports: list[RankReport]) -> list[RankReport]:
    """``reports`` (by rank), with no records and no file for a rank whose records equal a
    lower rank's ([Note: replicas the model cannot see]); its fragment stays."""
    seen: set[tuple] = set()
    kept = []
    for report in reports:
        if report.records and report.records in seen:
            report = report.without_pieces()
        seen.add(report.records)
        kept.append(report)
    return kept
