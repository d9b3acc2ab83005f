"""The ledger of collectives: what each rank issued, counted by kind, purpose and bytes.

Kept apart from :mod:`.collectives` (which records into it) for size; importable from
either module.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from ..base.validate import check_int


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective as this rank issued it."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast" | "all_to_all" |
    # "redistribute" | "send"
    purpose: str  # e.g. "params", "grads", "grad_presence", "init"
    num_bytes: int  # bytes of the full (unsharded) buffer the collective works on
    group_size: int
    unit: str = ""  # the unit it serves ("" for the root unit or none)
    elapsed_s: float | None = None  # issue to end of wait, when the ledger times collectives
    # Quantized (comm/quantized.py): the bytes the same collective moves unquantized; else 0.
    # Each pass of a quantized all-reduce carries the tensor's bytes: one ring pass of the
    # plain all-reduce ([Note: quantized all-reduce]).
    unquantized_bytes: int = 0
    # What this rank sent, where that is not a ring's share (a placed all-gather sends its
    # own pieces, not its shard's padding: [Note: placed all-gathers]); None: a ring's.
    sent_bytes: int | None = None

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends on a ring: (N-1)/N of the buffer, twice for an all-reduce;
        all of it for a point-to-point ``send``; :attr:`sent_bytes` where it is set."""
        if self.sent_bytes is not None:
            return float(self.sent_bytes)
        if self.kind == "send":
            return float(self.num_bytes)
        factor = 2.0 if self.kind == "all_reduce" else 1.0
        return factor * self.num_bytes * (self.group_size - 1) / self.group_size

    @property
    def unquantized_wire_bytes(self) -> float:
        """What :attr:`wire_bytes` would be without quantization (0: not quantized).

        A quantized record is an all-gather or an all-to-all, and what it replaces is one
        ring pass: an all-gather, a reduce-scatter, or half a plain all-reduce."""
        return self.unquantized_bytes * (self.group_size - 1) / self.group_size


# [Note: adopted ledgers]
# Each root counts its collectives in its own ledger. A root built around modules that
# already have roots (nested ``ShardedModule`` s, FSDP2's bottom-up ``fully_shard`` calls)
# adopts their units, whose communicators keep the ledger they were made with; the new
# root adopts those ledgers too, so its own ledger sees every collective of every unit it
# runs (what ``comm_ledger``, ``profile_step`` and the wire checks compare against), and
# an adopted ledger stays empty.

# Records a ledger keeps at most; see CommLedger.
MAX_LEDGER_RECORDS = 10_000


@dataclass
class CommLedger:
    """The collectives issued, oldest first; ``reset`` between measured steps.

    A training loop that never resets it must not grow it without end (every record is
    memory, and an object the garbage collector walks), so once it holds more than
    ``max_records`` the oldest records are dropped, half of them at a time: the last few
    hundred steps of a typical model stay readable. ``num_recorded`` counts every record
    ever made, dropped or not.
    """

    records: list[CommRecord] = field(default_factory=list)
    time_collectives: bool = False  # note each collective's wall time (shardwrap.profile)
    max_records: int = MAX_LEDGER_RECORDS
    num_recorded: int = 0
    # The ledger of the root that adopted this one's units ([Note: adopted ledgers]).
    adopted_by: CommLedger | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_int("max_records", self.max_records, minimum=2)

    def adopt(self, nested: CommLedger) -> None:
        """Record, from now on, what ``nested``'s communicators issue, after its records
        so far ([Note: adopted ledgers])."""
        if nested.adopted_by is not None or nested.final() is self:
            raise ValueError("adopt: that ledger already records into this one")
        self.records[:0] = nested.records
        self.num_recorded += nested.num_recorded
        nested.records = []
        nested.adopted_by = self

    def final(self) -> CommLedger:
        """The ledger this one's records go to: itself, or its adopter's."""
        ledger = self
        while ledger.adopted_by is not None:
            ledger = ledger.adopted_by
        return ledger

    @property
    def timing(self) -> bool:
        """Whether collectives recorded here are timed (their final ledger's switch)."""
        return self.final().time_collectives

    def last(self) -> CommRecord:
        """The record made last (in the final ledger)."""
        return self.final().records[-1]

    def record(self, record: CommRecord) -> None:
        if self.adopted_by is not None:
            self.final().record(record)
            return
        self.records.append(record)
        self.num_recorded += 1
        if len(self.records) > self.max_records:
            del self.records[: len(self.records) - self.max_records // 2]

    def recorded_since(self, num_recorded: int) -> list[CommRecord]:
        """The records made after ``num_recorded`` was read, as far as they are still kept."""
        count = self.num_recorded - num_recorded
        if count <= 0:
            return []
        # Fewer kept than made: some were dropped or reset away since; all that remain.
        return self.records[-count:] if count <= len(self.records) else list(self.records)

    def note_elapsed(self, record: CommRecord, seconds: float) -> None:
        """Attach a wall time to ``record`` (a no-op if the ledger was reset meanwhile)."""
        if self.adopted_by is not None:
            self.final().note_elapsed(record, seconds)
            return
        for index in range(len(self.records) - 1, -1, -1):
            if self.records[index] is record:
                self.records[index] = replace(record, elapsed_s=seconds)
                return

    def reset(self) -> None:
        self.records.clear()

    def count(self, kind: str, purpose: str | None = None) -> int:
        return sum(1 for r in self._matching(kind, purpose))

    def bytes(self, kind: str, purpose: str | None = None) -> int:
        return sum(r.num_bytes for r in self._matching(kind, purpose))

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(kind, purpose): (count, bytes)}``."""
        counts: Counter[tuple[str, str]] = Counter()
        sizes: Counter[tuple[str, str]] = Counter()
        for r in self.records:
            counts[(r.kind, r.purpose)] += 1
            sizes[(r.kind, r.purpose)] += r.num_bytes
        return {key: (counts[key], sizes[key]) for key in counts}

    def _matching(self, kind: str, purpose: str | None):
        return (
            r for r in self.records if r.kind == kind and (purpose is None or r.purpose == purpose)
        )
