"""Ranks that disagree: errors on every rank instead of a hang or a crash in the backend.

[Note: rank agreement]
Every rank must wrap the same model the same way and run the same units in the same
order; otherwise their collectives pair up wrongly. Collectives of different sizes end
inside the backend (a rank aborted, ``Connection reset by peer`` on the others) and
collectives of equal sizes silently mix different units' data. Two checks, on by
default, turn that into :class:`RankDisagreementError` on every rank, naming the first
rank that differs from rank 0 and the first unit where it differs:

* at wrap time, before any collective of the new model, each rank reduces one 64-bit
  digest of its plan (units, their parameters' names, shapes and dtypes, strategy and
  options): one all-reduce of 16 bytes per model;
* at the end of every synchronising backward, a digest of the units run since the last
  check (in order) rides along in the gradient presence vote, 16 bytes more in an
  all-reduce that runs anyway.

Only when the digests differ does each rank share its full description (an object
all-gather on the failure path alone) so that the error can say where they part.
The end-of-backward check comes after the step's collectives: a branch that changes
collective sizes can still fail in the backend first. ``set_collective_checks(True)``
(:class:`CollectiveChecker`) checks before every collective, at a cost per collective.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DIGEST_BITS = 60  # two 30-bit halves fit int32 words, negated too
_HALF = 30


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to issue different collectives (the run would have hung)."""


class CollectiveTimeoutError(RuntimeError):
    """A rank did not reach a collective within the checker's timeout (it hangs or died)."""


class RankDisagreementError(CollectiveMismatchError):
    """Ranks wrapped different models, policies or strategies, or ran different units."""


Entries = list[tuple[str, str]]  # (where, what this rank has there), e.g. ("unit 'a'", "...")


def digest(entries: Entries) -> int:
    """A ``DIGEST_BITS``-bit digest of ``entries`` (the same on every rank for equal ones)."""
    hasher = hashlib.blake2b(digest_size=8)
    for where, what in entries:
        hasher.update(f"{where}\x00{what}\x01".encode())
    return int.from_bytes(hasher.digest(), "little") >> (64 - DIGEST_BITS)


def digest_words(value: int) -> list[int]:
    """Four int32 words whose MAX-reduction tells whether every rank had ``value``."""
    high, low = value >> _HALF, value & ((1 << _HALF) - 1)
    return [high, low, -high, -low]


def words_agree(reduced: list[int]) -> bool:
    """After a MAX all-reduce of :func:`digest_words`: the maximum equals the minimum."""
    high_max, low_max, neg_high_min, neg_low_min = reduced
    return high_max == -neg_high_min and low_max == -neg_low_min


def check_agreement(comm: Any, entries: Entries, what: str) -> None:
    """Raise :class:`RankDisagreementError` on every rank of ``comm`` unless all ranks
    pass equal ``entries``. Costs one all-reduce of 16 bytes when they agree."""
    value = digest(entries)
    flags = torch.tensor([value, -value], dtype=torch.int64)
    comm.all_reduce(flags, purpose="agreement", op=dist.ReduceOp.MAX).wait()
    if int(flags[0]) != -int(flags[1]):
        raise_disagreement(comm, entries, what)


def raise_disagreement(comm: Any, entries: Entries, what: str) -> None:
    """On the failure path: gather every rank's entries and name where they part."""
    everyone: list = comm.all_gather_object(entries, purpose="agreement")
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        position = next(
            (i for i, (a, b) in enumerate(zip(reference, theirs, strict=False)) if a != b),
            min(len(reference), len(theirs)),
        )
        ours, other = _at(reference, position), _at(theirs, position)
        where = (ours or other)[0]  # type: ignore[index]
        raise RankDisagreementError(
            f"ranks disagree on {what}: rank {rank} differs from rank 0 first at {where} "
            f"(rank 0: {_said(ours, where)}; rank {rank}: {_said(other, where)}). This is "
            f"rank {comm.rank}. Every rank must wrap the same model with the same policy and "
            "options, and run the same units in the same order."
        )
    raise RankDisagreementError(
        f"ranks disagree on {what}, but their descriptions match (a digest collision?)"
    )


def _at(entries: Entries, position: int) -> tuple[str, str] | None:
    return tuple(entries[position]) if position < len(entries) else None  # type: ignore[return-value]


def _said(entry: tuple[str, str] | None, where: str) -> str:
    if entry is None:
        return f"nothing there (its list ends before {where})"
    return entry[1] if entry[0] == where else f"{entry[0]}: {entry[1]}"


class CollectiveChecker:
    """Debug aid: before each collective, every rank confirms it is about to run the same one.

    [Note: hangs become errors]
    A rank that takes another branch issues a different collective (or one for another
    unit) and the job hangs until the process-group timeout. With a checker, each rank
    first shares a small signature (unit, kind, purpose, element count, dtype) over the
    world group; any difference raises :class:`CollectiveMismatchError` on every rank,
    naming the first rank that differs from rank 0 and the units involved. On gloo a
    monitored barrier first names ranks that never reach the check at all. It costs one
    small object all-gather per collective, so it is off unless asked for.
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.num_checked = 0

    def check(self, kind: str, purpose: str, unit: str, tensor: torch.Tensor, size: int) -> None:
        mine = (unit, kind, purpose, tensor.numel(), str(tensor.dtype), size)
        if dist.get_backend() == "gloo":
            self._wait_for_all(mine)
        signatures: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(signatures, mine)
        self.num_checked += 1
        for rank, theirs in enumerate(signatures):
            if theirs != signatures[0]:
                raise CollectiveMismatchError(
                    f"collective #{self.num_checked} diverged first at rank {rank}: rank 0 is "
                    f"about to run {_describe(signatures[0])}, rank {rank} {_describe(theirs)} "
                    f"(this rank, {dist.get_rank()}: {_describe(mine)}). A rank took another "
                    "branch through the model; every rank must run the same units in order."
                )

    def _wait_for_all(self, mine: tuple) -> None:
        """gloo's monitored barrier, its failure raised as a named error: torch's message
        names the ranks that did not arrive (rank 0 waits for all of them; another rank
        names rank 0 when rank 0 does not answer), ours the collective."""
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
        except RuntimeError as exc:
            raise CollectiveTimeoutError(
                f"rank {dist.get_rank()}: collective #{self.num_checked + 1}, "
                f"{_describe(mine)}: not every rank reached it within {self.timeout_s} s "
                f"(set_collective_checks timeout_s): {exc}"
            ) from exc


def _describe(signature: object) -> str:
    unit, kind, purpose, numel, dtype, _ = signature  # type: ignore[misc]
    return f"{kind} of {purpose} for unit {unit or '<root>'!r} ({numel} x {dtype})"
