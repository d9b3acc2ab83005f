"""How every rank of a checkpoint save or load learns whether all succeeded.

A failure on one rank must raise on all of them, not leave the others waiting in a
collective. What travels does not grow with the number of ranks unless something failed:
a fixed-size all-reduce says whether any rank failed; only then does every rank share its
error text, so that all raise the same error naming each failing rank.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import torch

from ..comm.json_values import all_gather_json
from .format import CheckpointError


def agree_on_id(comm, failed: bool) -> tuple[str, int]:
    """Rank 0's fresh save id, and how many ranks failed: one 16-byte all-reduce."""
    proposal = secrets.randbits(63) if comm.rank == 0 else 0
    agreed = torch.tensor([proposal, int(failed)], dtype=torch.int64)
    comm.all_reduce(agreed, purpose="checkpoint").wait()
    return f"{int(agreed[0]):016x}", int(agreed[1])


def settle(
    comm, what: str, root: str, report: dict, undo=None, *, failures=None, purpose="checkpoint"
) -> None:
    """Raise on every rank if any rank failed; error details travel only on failure.

    A 4-byte all-reduce says whether any rank failed (unless ``failures`` already says);
    only then does every rank share its error text.
    """
    if failures is None:
        flag = torch.tensor([1 if report["error"] else 0], dtype=torch.int32)
        comm.all_reduce(flag, purpose=purpose).wait()
        failures = int(flag)
    if failures:  # error texts as JSON: [Note: no pickle between ranks] in comm/json_values.py
        errors = all_gather_json(comm, report["error"], purpose=purpose)
        raise_failures(what, root, [{"error": e} for e in errors], undo)


def check_json(argument: str, value: Any) -> dict[str, Any]:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{argument}: must be JSON-serialisable ({exc})") from exc
    return {}


def guarded(action) -> dict[str, Any]:
    """Run ``action``; return its result dict, or the error as text for the other ranks."""
    try:
        return {"error": None, **action()}
    except Exception as exc:  # noqa: BLE001 - every rank must learn about every failure
        return {"error": f"{type(exc).__name__}: {exc}"}


def raise_failures(what: str, root: str, reports: list[dict[str, Any]], undo=None) -> None:
    failed = [(rank, r["error"]) for rank, r in enumerate(reports) if r["error"]]
    if failed and undo is not None:
        undo()
    if failed:
        details = "; ".join(f"rank {rank}: {error}" for rank, error in failed)
        raise CheckpointError(f"{what} of checkpoint {root} failed on {details}")
