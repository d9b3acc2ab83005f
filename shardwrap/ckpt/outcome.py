"""How every rank of a checkpoint save or load learns whether all succeeded.

A failure on one rank must raise on all of them, not leave the others waiting in a
collective. What travels does not grow with the number of ranks unless something failed:
a fixed-size all-reduce says whether any rank failed; only then does every rank share its
error text, so that all raise the same error naming each failing rank.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from ..comm.json_values import all_gather_json
from .format import CheckpointError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """What one rank's step gave: its value, or its error as text for the other ranks."""

    value: T | None = None
    error: str | None = None


def agree_on_id(comm, failed: bool) -> tuple[str, int]:
    """Rank 0's fresh save id, and how many ranks failed: one 16-byte all-reduce."""
    proposal = secrets.randbits(63) if comm.rank == 0 else 0
    agreed = torch.tensor([proposal, int(failed)], dtype=torch.int64)
    comm.all_reduce(agreed, purpose="checkpoint").wait()
    return f"{int(agreed[0]):016x}", int(agreed[1])


def settle(
    comm,
    what: str,
    root: str,
    error: str | None,
    undo: Callable[[], None] | None = None,
    *,
    failures: int | None = None,
    purpose: str = "checkpoint",
) -> None:
    """Raise on every rank if any rank failed (``error``: this rank's, or None); error
    details travel only on failure.

    A 4-byte all-reduce says whether any rank failed (unless ``failures`` already says);
    only then does every rank share its error text.
    """
    if failures is None:
        flag = torch.tensor([1 if error else 0], dtype=torch.int32)
        comm.all_reduce(flag, purpose=purpose).wait()
        failures = int(flag)
    if failures:  # error texts as JSON: [Note: no pickle between ranks] in comm/json_values.py
        raise_failures(what, root, all_gather_json(comm, error, purpose=purpose), undo)


def check_json(argument: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{argument}: must be JSON-serialisable ({exc})") from exc


def json_snapshot(argument: str, value: Any) -> Any:
    """``value`` (JSON) copied as of now: later changes to it do not reach the copy."""
    check_json(argument, value)
    return json.loads(json.dumps(value, allow_nan=True))


def guarded(action: Callable[[], T]) -> Outcome[T]:
    """Run ``action``; its result, or the error as text for the other ranks."""
    try:
        return Outcome(value=action())
    except Exception as exc:  # noqa: BLE001 - every rank must learn about every failure
        return Outcome(error=f"{type(exc).__name__}: {exc}")


def raise_failures(
    what: str, root: str, errors: list[str | None], undo: Callable[[], None] | None = None
) -> None:
    """Raise one error naming every failing rank (``errors``: by rank, None for success)."""
    failed = [(rank, error) for rank, error in enumerate(errors) if error]
    if failed and undo is not None:
        undo()
    if failed:
        details = "; ".join(f"rank {rank}: {error}" for rank, error in failed)
        raise CheckpointError(f"{what} of checkpoint {root} failed on {details}")
