"""The gradient presence vote: which shard views get a gradient, agreed by every rank.

[Note: gradient presence]
In single-process training a parameter that takes no part in the loss keeps
``grad=None``, so the optimizer leaves it alone (no momentum, no weight decay). A rank
cannot tell that alone: the parameter may have been used by another rank's data. Each
unit therefore reduces zeros for its missing gradients, and once per optimizer-visible
gradient update one small all-reduce (MAX) of per-parameter "had a gradient" flags
decides, for every rank alike, which shard views receive a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..comm.checks import digest, digest_words, raise_disagreement, words_agree
from ..comm.collectives import Communicator
from ..flat_param import FlatParamHandle

NUM_DIGEST_WORDS = 4  # appended to the presence vote: see [Note: rank agreement]


@dataclass(frozen=True)
class PresenceVote:
    """A presence vote in flight: its work, the flags it reduces, the handles they cover."""

    work: Any
    flags: torch.Tensor  # int32, one per parameter of ``handles``, in order
    handles: list[FlatParamHandle]

    def finish(self) -> bool:
        """Wait, then hand each handle's reduced gradient to the shard views that got one.

        Returns whether every rank ran the same units ([Note: rank agreement]).
        """
        self.work.wait()
        reduced = self.flags.tolist()
        flags = [bool(f) for f in reduced[:-NUM_DIGEST_WORDS]]
        start = 0
        for handle in self.handles:
            count = len(handle.grads.local_grad_present)
            handle.grads.assign_grads(flags[start : start + count])
            start += count
        return words_agree(reduced[-NUM_DIGEST_WORDS:])


def run_entries(names: list[str]) -> list[tuple[str, str]]:
    """The units run (by name, in order) as the entries a rank-agreement check compares."""
    return [(f"unit #{i + 1} run", f"unit {n or '(root)'!r}") for i, n in enumerate(names)]


def start_vote(
    world_comm: Communicator, handles: list[FlatParamHandle], entries: list[tuple[str, str]]
) -> PresenceVote:
    """Issue the vote over ``handles``' presence flags, with the digest of ``entries``."""
    words = digest_words(digest(entries))
    flags = torch.tensor(
        [int(f) for h in handles for f in h.grads.local_grad_present] + words,
        dtype=torch.int32,
    )
    work = world_comm.all_reduce(flags, purpose="grad_presence", op=dist.ReduceOp.MAX)
    return PresenceVote(work, flags, handles)


class PresenceCheck:
    """One root's presence votes and what each checks: the units run (names, in order)
    since the last vote, agreed by every rank ([Note: rank agreement])."""

    def __init__(self, world_comm: Communicator) -> None:
        self.world_comm = world_comm
        self.units_run: list[str] = []  # since the last vote checked them
        self._checked: list[tuple[str, str]] = []  # what the last vote checked

    def note_run(self, units: list[Any]) -> None:
        """``units`` (in forward order) ran in the backward that just ended."""
        self.units_run.extend(u.name for u in units)

    def start(self, handles: list[FlatParamHandle]) -> PresenceVote | None:
        """Issue the presence vote of ``handles`` (see [Note: gradient presence])."""
        entries = run_entries(self.units_run)
        self.units_run.clear()  # checked now, or never: nothing to vote on (no handles)
        if not handles:
            return None
        self._checked = entries
        return start_vote(self.world_comm, handles, entries)

    def vote_and_assign(self, handles: list[FlatParamHandle]) -> None:
        """All-reduce the presence flags of ``handles`` and hand their reduced gradients to
        the shard views; a disagreement raises."""
        vote = self.start(handles)
        if vote is not None and not vote.finish():
            self.report_disagreement()

    def report_disagreement(self) -> None:
        """The vote's digests differ: name the first rank and unit run that differ."""
        raise_disagreement(self.world_comm, self._checked, "the units run since the last check")

    def check_late_grads(self, units: list[Any]) -> None:
        """Refuse gradients that reached one of ``units`` after it was reduced."""
        for unit in units:
            late = unit.handle.grads.late_grad_names() if unit.handle is not None else []
            if late:
                raise RuntimeError(
                    f"rank {self.world_comm.rank}: unit {unit.name!r} received gradients for "
                    f"{late} after it was reduced; a parameter is used outside its unit's "
                    "forward. Wrap the module that uses it, or put both in one unit."
                )
