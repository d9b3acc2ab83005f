"""A measured ledger users can read: where a step's bytes, time and memory go.

Two views, both measured (nothing here is estimated from formulas):

* :func:`memory_by_category`: bytes this rank holds right now for one ``ShardedModule``
  and its optimizer, split into gathered (full) parameters, parameter shards, gradients
  and optimizer state. Tensors that share storage are counted once.
* :func:`profile_step`: a context manager around one training step that returns, per
  unit, collective kind and purpose, how many collectives were issued, the bytes of the
  full buffers they worked on and the wall time from issue to the end of their wait.

[Note: labelling traffic by unit]
Every handle talks through a :class:`~shardwrap.comm.collectives.Communicator` that writes to
the root's ledger, and every collective a handle issues carries its unit's name, so every
record says which unit issued it. The
root module's unit is shown as ``"(root)"``; root-wide traffic that belongs to no single
unit (the gradient-presence vote) keeps the empty label, shown as ``"(all units)"``. A
reduce bucket ([Note: reduce buckets]) is one collective for several units, recorded
once under a label that names its first and last units and their number
(``"layers.1..(root) (3 units)"``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .assemble.root import root_of
from .comm.collectives import ROOT_LABEL as ROOT_LABEL  # re-exported: how the root unit is named
from .wrap import ShardedModule

SHARED_LABEL = "(all units)"  # records without a unit label: root-wide traffic

MEMORY_CATEGORIES = ("full_params", "param_shards", "grads", "optimizer_state")


# ------------------------------------------------------------------- memory
def memory_by_category(
    model: ShardedModule, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes this rank holds now, by category (each storage counted once).

    * ``full_params``: gathered buffers currently allocated (0 once every unit resharded
      and freed them; always 0 for units of one shard whose shard is the full tensor, that
      is without a low-precision or CPUOffload device copy), and ZeRO++'s hpZ secondary
      shards kept from forward to backward;
    * ``param_shards``: each unit's flat shard, padding included;
    * ``grads``: gradients on the shard views, local gradients still on the full views
      (under ``no_sync``) and reduced gradients waiting for the presence vote;
    * ``optimizer_state``: every tensor ``optimizer`` keeps for this model's parameters
      (for AdamW: ``exp_avg``, ``exp_avg_sq`` and the one-element ``step``).
    """
    root = root_of(model)
    counted: set[tuple[int, int]] = set()
    totals = dict.fromkeys(MEMORY_CATEGORIES, 0)
    handles = [u.handle for u in root.units if u.handle is not None]
    for handle in handles:
        if handle.separate_full:
            totals["full_params"] += _storage_bytes(handle.flat_full, counted)
        totals["param_shards"] += _storage_bytes(handle.flat_shard, counted)
        if handle.comm_quant is not None:  # hpZ: a secondary shard of the gathered copy
            totals["full_params"] += handle.comm_quant.secondary_bytes
    for handle in handles:
        grads = [p.grad for p in (*handle.shard_params, *handle.full_params)]
        grads.append(handle.grads.pending_grad_shard)
        totals["grads"] += sum(_storage_bytes(g, counted) for g in grads if g is not None)
    if optimizer is not None:
        totals["optimizer_state"] = _optimizer_state_bytes(optimizer, handles, counted)
    return totals


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer, handles, counted) -> int:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer)}")
    total = 0
    for handle in handles:
        for param in handle.shard_params:
            for value in optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    total += _storage_bytes(value, counted)
    return total


def _storage_bytes(tensor: torch.Tensor, counted: set[tuple[int, int]]) -> int:
    """Bytes of ``tensor``'s storage, or 0 if that storage was already counted."""
    storage = tensor.untyped_storage()
    key = (storage.data_ptr(), storage.size())
    if storage.size() == 0 or key in counted:
        return 0
    counted.add(key)
    return storage.size()


# ------------------------------------------------------------- collectives
@dataclass(frozen=True, slots=True)
class CollectiveStats:
    """The collectives of one (unit, kind, purpose) in a step, on this rank."""

    unit: str
    kind: str
    purpose: str
    count: int
    num_bytes: int  # bytes this rank sent into them
    seconds: float  # summed wall time, issue to end of wait
    # bytes the same collectives move without ZeRO++'s quantization (0: none quantized)
    unquantized_bytes: int = 0
    wire_bytes: float = 0.0  # bytes this rank sends on a ring (CommRecord.wire_bytes)
    unquantized_wire_bytes: float = 0.0  # the same, unquantized (0: none quantized)

    @property
    def saved_bytes(self) -> int:
        """Ledger bytes quantization saved ([Note: quantized collectives]), in the ledger's
        unit: a buffer's bytes once per ring pass (a plain all-reduce makes two)."""
        return self.unquantized_bytes - self.num_bytes if self.unquantized_bytes else 0

    @property
    def saved_wire_bytes(self) -> float:
        """Bytes per rank on the wire quantization saved, against the plain collective
        (for qgZ across replicas: the fp32 ring all-reduce, ``8 n (R-1) / R``)."""
        return self.unquantized_wire_bytes - self.wire_bytes if self.unquantized_bytes else 0.0


@dataclass
class StepProfile:
    """What :func:`profile_step` measured; filled in when the ``with`` block exits."""

    wall_s: float = 0.0
    collectives: list[CollectiveStats] = field(default_factory=list)

    def bytes(self, kind: str, purpose: str | None = None, unit: str | None = None) -> int:
        """Bytes sent into collectives of ``kind`` (optionally one purpose and unit)."""
        return sum(s.num_bytes for s in self._matching(kind, purpose, unit))

    def seconds(self, kind: str, purpose: str | None = None, unit: str | None = None) -> float:
        return sum(s.seconds for s in self._matching(kind, purpose, unit))

    def count(self, kind: str, purpose: str | None = None, unit: str | None = None) -> int:
        return sum(s.count for s in self._matching(kind, purpose, unit))

    def wire_bytes(self, kind: str, purpose: str | None = None, unit: str | None = None) -> float:
        """Bytes this rank sent on the wire in collectives of ``kind`` (ring counts)."""
        return sum(s.wire_bytes for s in self._matching(kind, purpose, unit))

    def saved_bytes(self, unit: str | None = None) -> int:
        """Ledger bytes ZeRO++'s quantized collectives saved (of one unit, or all)."""
        return sum(s.saved_bytes for s in self.collectives if unit is None or s.unit == unit)

    def saved_wire_bytes(self, unit: str | None = None) -> float:
        """Wire bytes per rank ZeRO++'s quantized collectives saved against the plain
        ones (of one unit, or all)."""
        return sum(s.saved_wire_bytes for s in self.collectives if unit is None or s.unit == unit)

    def by_kind(self) -> dict[str, tuple[int, int, float]]:
        """``{kind: (count, bytes, seconds)}`` summed over units and purposes."""
        out: dict[str, tuple[int, int, float]] = {}
        for s in self.collectives:
            count, num_bytes, seconds = out.get(s.kind, (0, 0, 0.0))
            out[s.kind] = (count + s.count, num_bytes + s.num_bytes, seconds + s.seconds)
        return out

    def table(self) -> str:
        """A plain-text table, one line per (unit, kind, purpose)."""
        lines = [
            f"{'unit':<24} {'kind':<18} {'purpose':<14} {'count':>5} {'bytes':>12} "
            f"{'wire':>12} {'wire saved':>12} {'ms':>9}"
        ]
        for s in self.collectives:
            lines.append(
                f"{s.unit:<24} {s.kind:<18} {s.purpose:<14} {s.count:>5} {s.num_bytes:>12} "
                f"{s.wire_bytes:>12.0f} {s.saved_wire_bytes:>12.0f} {1e3 * s.seconds:>9.2f}"
            )
        lines.append(f"step wall time: {1e3 * self.wall_s:.2f} ms")
        return "\n".join(lines)

    def _matching(self, kind: str, purpose: str | None, unit: str | None):
        for s in self.collectives:
            if s.kind != kind or (purpose is not None and s.purpose != purpose):
                continue
            if unit is None or s.unit == unit:
                yield s


@contextlib.contextmanager
def profile_step(model: ShardedModule) -> Iterator[StepProfile]:
    """Measure the collectives and wall time of the code inside the ``with`` block.

    Include ``optimizer.step()`` in the block to see ZeRO-1's reduction and the
    all-gathers a changed shard causes. The ledger's earlier records are kept.
    """
    ledger = root_of(model).comm_ledger
    previous_timing = ledger.time_collectives
    ledger.time_collectives = True
    first = ledger.num_recorded
    result = StepProfile()
    start = time.perf_counter()
    try:
        yield result
    finally:
        result.wall_s = time.perf_counter() - start
        ledger.time_collectives = previous_timing
        result.collectives = summarize(ledger.recorded_since(first))


def summarize(records) -> list[CollectiveStats]:
    """Group ledger records by (unit, kind, purpose), in first-seen order."""
    groups: dict[tuple[str, str, str], list] = {}
    for r in records:
        groups.setdefault((r.unit or SHARED_LABEL, r.kind, r.purpose), []).append(r)
    return [
        CollectiveStats(
            unit=unit,
            kind=kind,
            purpose=purpose,
            count=len(rs),
            num_bytes=sum(r.num_bytes for r in rs),
            seconds=sum(r.elapsed_s or 0.0 for r in rs),
            unquantized_bytes=_unquantized(rs),
            wire_bytes=sum(r.wire_bytes for r in rs),
            unquantized_wire_bytes=_unquantized_wire(rs),
        )
        for (unit, kind, purpose), rs in groups.items()
    ]


def _unquantized(records) -> int:
    """What ``records`` would move unquantized; 0 when none was quantized."""
    if not any(r.unquantized_bytes for r in records):
        return 0
    return sum(r.unquantized_bytes or r.num_bytes for r in records)


def _unquantized_wire(records) -> float:
    """What ``records`` would send per rank unquantized; 0 when none was quantized."""
    if not any(r.unquantized_bytes for r in records):
        return 0.0
    return sum(r.unquantized_wire_bytes if r.unquantized_bytes else r.wire_bytes for r in records)
