"""Which checkpoint to resume from: the newest complete one whose checksums hold.

[Note: choosing among checkpoints]
:func:`choose` (``newest_checkpoint`` in tiered_load.py) runs on every rank and gives
every rank the same answer. Each rank lists the candidates it can see (the step folders
of its node's memory-tier folder, of the disk tier, or the folders it is given; one
all-gather makes the union), and then, newest first, verifies its share of one
candidate's files:

* a memory-tier candidate's files in its node's folder (its own ranks' files and the
  peer copies), shared among the node's ranks;
* a disk candidate's (or a given folder's) files, shared among all ranks;

a safetensors file by its size and sha256 from the index, a run file by the digest in it
(``run_state.read_run_file``). One all-gather of JSON reports (which index each rank
read, which files it verified, which it found bad and why) then lets every rank make the
same verdict: the candidate is taken when an index was read and every file it names (and
every rank's run file) is held verified by some rank's folder. Otherwise it is skipped
with its reason (:class:`SkipReason`) and the files that caused it, and the next one is
tried: newest step first, a memory candidate before a disk one of the same step, given
folders in the order given. Holding a file anywhere is enough: a memory-tier file lost or
damaged on one node is brought back from a node holding a good copy before the load
(tiered_load.py).

Every file of the candidates tried is hashed (spread over the ranks), and the load hashes
the chunks it reads again.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Any

from ..comm.collectives import Communicator
from ..comm.json_values import all_gather_json
from .format import INDEX_NAME, CheckpointError, CheckpointIndex, read_index
from .nodes import NodeMap
from .reader import file_sha256
from .run_state import META_KEY, read_run_file, run_file_name
from .tier_options import CheckpointTiers, saved_steps, step_folder


class Tier(enum.Enum):
    """Where a candidate checkpoint lives."""

    MEMORY = "memory"  # a step of the memory tier: one folder per node
    DISK = "disk"  # a step of the disk tier
    FOLDER = "folder"  # a checkpoint folder given by path


class SkipReason(enum.Enum):
    """Why a candidate was not taken."""

    INCOMPLETE = "incomplete"  # no index: the save did not finish
    UNREADABLE_INDEX = "unreadable index"  # an index that does not parse
    MISSING_FILE = "missing file"  # a file the index names is in no folder
    DIGEST_MISMATCH = "digest mismatch"  # every copy of a file fails its checksum


@dataclass(frozen=True, slots=True)
class Candidate:
    """One checkpoint a load may take."""

    tier: Tier
    step: int | None  # None for a given folder
    where: str  # the folder (for the memory tier: its node folders' pattern)

    @property
    def key(self) -> str:
        return f"{self.tier.value}:{self.step}:{self.where}"

    def __str__(self) -> str:
        step = "" if self.step is None else f" step {self.step}"
        return f"{self.tier.value}{step} ({self.where})"


@dataclass(frozen=True, slots=True)
class Skipped:
    """A candidate not taken, and why."""

    candidate: Candidate
    reason: SkipReason
    detail: str  # the files and ranks that caused it

    def __str__(self) -> str:
        return f"skipped {self.candidate}: {self.reason.value}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Selection:
    """The choice, the same on every rank."""

    chosen: Candidate | None
    skipped: tuple[Skipped, ...]
    path: str | None  # this rank's folder of the chosen checkpoint
    # For the chosen one: which world ranks' folders hold each file verified, and its sha256.
    holders: dict[str, tuple[int, ...]] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        took = f"took {self.chosen}" if self.chosen else "found no loadable checkpoint"
        return "; ".join([took, *map(str, self.skipped)])


class Locations:
    """The candidates of one load as this rank sees them, and its folder of each."""

    def __init__(
        self,
        comm: Communicator,
        tiers: CheckpointTiers | None,
        nodes: NodeMap | None,
        paths: list[str],
    ) -> None:
        self.comm = comm
        self.tiers = tiers
        self.nodes = nodes  # set when the tiers have a memory tier
        self.paths = paths  # given folders, preferred first

    def visible(self) -> list[Candidate]:
        """The candidates this rank's folders hold (a lost node's replacement: none of
        the memory tier's)."""
        found = [Candidate(Tier.FOLDER, None, p) for p in self.paths]
        tiers = self.tiers
        if tiers is not None and tiers.memory is not None:
            root = self._node_root()
            pattern = os.path.join(tiers.memory, "node-*")
            found += [Candidate(Tier.MEMORY, step, pattern) for step in saved_steps(root)]
        if tiers is not None and tiers.disk is not None:
            found += [Candidate(Tier.DISK, s, f) for s, f in saved_steps(tiers.disk).items()]
        return found

    def folder(self, candidate: Candidate) -> str:
        """This rank's folder of ``candidate`` (for the memory tier: in its node's)."""
        if candidate.tier is Tier.MEMORY:
            return step_folder(self._node_root(), candidate.step)
        return candidate.where

    def share(self, candidate: Candidate) -> tuple[int, int]:
        """Which of the candidate's files this rank verifies: every ``count``-th from
        ``first``, among the ranks that see the same folder."""
        if candidate.tier is Tier.MEMORY:
            return self.nodes.local_index(self.comm.rank), self.nodes.ranks_per_node
        return self.comm.rank, self.comm.size

    def _node_root(self) -> str:
        assert self.tiers is not None and self.nodes is not None
        return self.tiers.node_folder(self.nodes.node_of(self.comm.rank))


def choose(locations: Locations) -> Selection:
    """Agree on the candidates, then verify them newest first until one holds; on every
    rank ([Note: choosing among checkpoints])."""
    comm = locations.comm
    visible = locations.visible()
    seen = [[c.tier.value, c.step, c.where] for c in visible]
    candidates = {}
    for listed in all_gather_json(comm, seen, purpose="checkpoint"):
        for tier, step, where in listed:
            candidate = Candidate(Tier(tier), step, where)
            candidates[candidate.key] = candidate
    mine = {c.key for c in visible}
    skipped = []
    for candidate in sorted(candidates.values(), key=lambda c: _rank_key(c, locations.paths)):
        folder = locations.folder(candidate)
        report = None
        if candidate.key in mine:
            report = _report(candidate, folder, locations.share(candidate))
        verdict = _judge(candidate, all_gather_json(comm, report, purpose="checkpoint"))
        if isinstance(verdict, Skipped):
            skipped.append(verdict)
            continue
        holders, digests = verdict
        return Selection(candidate, tuple(skipped), folder, holders, digests)
    return Selection(None, tuple(skipped), None)


def _rank_key(candidate: Candidate, order: list[str]) -> tuple:
    if candidate.tier is Tier.FOLDER:
        return (1, order.index(candidate.where), 0)
    tier_order = 0 if candidate.tier is Tier.MEMORY else 1
    return (0, -candidate.step, tier_order)


# ------------------------------------------------------------------ one rank's report
def _report(candidate: Candidate, folder: str, share: tuple[int, int]) -> dict[str, Any]:
    """This rank's view of one candidate: the index it read and its share of the files."""
    local = candidate.tier is Tier.MEMORY  # a file absent from it may be on another node
    report: dict[str, Any] = {"index": None, "error": None, "required": None, "held": {}, "bad": {}}
    if not os.path.exists(os.path.join(folder, INDEX_NAME)):
        return report
    try:
        index = read_index(folder)
        report["index"] = file_sha256(os.path.join(folder, INDEX_NAME))
    except (OSError, CheckpointError) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        return report
    required = _required(index)
    first, count = share
    if first == 0:  # one report per folder names the files
        report["required"] = required
    names = [n for n in required if not local or os.path.exists(os.path.join(folder, n))]
    for name in names[first::count]:
        problem, digest = _verify(folder, index, name)
        if problem is None:
            report["held"][name] = digest
        else:
            report["bad"][name] = problem
    return report


def _required(index: CheckpointIndex) -> list[str]:
    """Every file of a checkpoint: those its index lists, and every rank's run file."""
    names = sorted(index.files)
    if index.meta.get(META_KEY) is not None:
        save_id = str(index.meta.get("save_id"))
        names += [run_file_name(save_id, r) for r in range(int(index.meta["world_size"]))]
    return names


def _verify(folder: str, index: CheckpointIndex, name: str) -> tuple[str | None, str]:
    """``(None, sha256)`` for a good file, ``(what is wrong, "")`` otherwise."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return "missing", ""
    entry = index.files.get(name)
    try:
        if entry is None:  # a run file: its own digest, and that it is this save's
            save_id = str(index.meta.get("save_id"))
            rank = int(name.removeprefix(f"{save_id}-rank").removesuffix(".run.json"))
            read_run_file(folder, save_id, rank)
            return None, file_sha256(path)
        if os.path.getsize(path) != entry.size:
            return f"size {os.path.getsize(path)}, the index says {entry.size}", ""
        digest = file_sha256(path)
    except (OSError, CheckpointError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}", ""
    if digest != entry.sha256:
        return "sha256 mismatch", ""
    return None, digest


# ------------------------------------------------------------------ the common verdict
def _judge(candidate: Candidate, per_rank: list) -> Skipped | tuple[dict, dict]:
    """Skipped, or ``(holders, digests)``: the same on every rank (from every report)."""
    agreeing = _agreeing_index(candidate, per_rank)
    if isinstance(agreeing, Skipped):
        return agreeing
    required = next((rep["required"] for _, rep in agreeing if rep["required"] is not None), None)
    if required is None:  # no folder's first rank read this index
        return Skipped(
            candidate, SkipReason.INCOMPLETE, f"{INDEX_NAME} seen by no folder's first rank"
        )
    holders: dict[str, list[int]] = {INDEX_NAME: [r for r, _ in agreeing]}
    digests = {INDEX_NAME: agreeing[0][1]["index"]}
    bad: dict[str, list[str]] = {}
    for rank, rep in agreeing:
        for name, digest in rep["held"].items():
            holders.setdefault(name, []).append(rank)
            digests[name] = digest
        for name, problem in rep["bad"].items():
            bad.setdefault(name, []).append(f"rank {rank}'s folder: {problem}")
    damaged = [n for n in required if n not in holders and n in bad]
    missing = [n for n in required if n not in holders and n not in bad]
    if damaged:
        shown = "; ".join(f"{n} ({', '.join(bad[n])})" for n in damaged[:3])
        return Skipped(candidate, SkipReason.DIGEST_MISMATCH, shown)
    if missing:
        memory = candidate.tier is Tier.MEMORY
        where = "in any surviving node's folder" if memory else "in the folder"
        return Skipped(candidate, SkipReason.MISSING_FILE, f"{', '.join(missing[:3])} not {where}")
    return {n: tuple(r) for n, r in holders.items()}, digests


def _agreeing_index(candidate: Candidate, per_rank: list) -> Skipped | list[tuple[int, dict]]:
    """The reports of the ranks that read the lowest such rank's index (a memory tier's
    folder holding another save's index counts as holding nothing); or why none."""
    with_index = [(r, rep) for r, rep in enumerate(per_rank) if rep and rep["index"]]
    errors = [(r, rep["error"]) for r, rep in enumerate(per_rank) if rep and rep["error"]]
    if errors and (candidate.tier is not Tier.MEMORY or not with_index):
        rank, error = errors[0]
        return Skipped(candidate, SkipReason.UNREADABLE_INDEX, f"rank {rank}: {error}")
    if not with_index:
        return Skipped(
            candidate, SkipReason.INCOMPLETE, f"no {INDEX_NAME} (the save did not finish)"
        )
    canonical = with_index[0][1]["index"]
    return [(r, rep) for r, rep in with_index if rep["index"] == canonical]
