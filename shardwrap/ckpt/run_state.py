"""The run in a checkpoint: each rank's random number streams and data position.

[Note: run state files]
Next to its safetensors file every rank writes ``<save_id>-rank<r>.run.json``: one small
JSON record of its own (nothing is exchanged between ranks, nothing grows with the world
size) holding

* ``rng``: torch's CPU generator, the current accelerator's generator (when there is one),
  Python's ``random`` and NumPy's global generator (when NumPy is imported);
* ``data``: the JSON ``state_dict()`` of the sampler passed to ``save_checkpoint`` (or null),

plus the save id, the rank and a sha256 of the record. The index says that run files
exist (``run_state`` in its header); their names follow from the save id, so a loading
rank opens only its own, and at a changed world size also rank 0's:

* rank ``r`` restores the streams saved by rank ``r`` when that rank existed; a rank that
  did not exist seeds every generator from a hash of rank 0's record and its own rank
  (deterministic for a given checkpoint, different for every rank);
* the data position comes from the rank's own record at the same world size, else from
  rank 0's: only a position that means the same at every world size (``ResumableSampler``'s
  is the global number of samples consumed) can be carried to another world size.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..base.validate import unique_keys
from .format import CheckpointError, write_atomic
from .generators import RunSnapshot, Streams, derive_rng, rng_json, snapshot_run
from .piece_records import KindLoad, LoadContext, PlannedRead, SaveContext, Saved

META_KEY = "run_state"
RUN_FORMAT = "shardwrap-run-state"
RUN_VERSION = 1


def run_file_name(save_id: str, rank: int) -> str:
    return f"{save_id}-rank{rank:05d}.run.json"


def index_record(sampler: Any) -> dict[str, Any]:
    """What the index says of the run files (from world rank 0)."""
    return {"version": RUN_VERSION, "data": sampler is not None}


def check_sampler(argument: str, sampler: Any, method: str) -> None:
    if sampler is not None and not callable(getattr(sampler, method, None)):
        raise TypeError(
            f"{argument}: expected an object with {method}() (e.g. shardwrap.data.sampler."
            f"ResumableSampler), got {type(sampler).__name__}"
        )


# ------------------------------------------------------------------------ files
def _digest(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_run_file(root: str, save_id: str, rank: int, world_size: int, sampler: Any) -> str:
    """Write this rank's run record (durably); returns its file name."""
    name, text = run_file_bytes(save_id, rank, world_size, sampler)
    write_atomic(root, name, text)
    return name


def save_run(ctx: SaveContext) -> Saved:
    """:attr:`StateKind.RUN`'s save: this rank's run file, and the index's record of them."""
    return take_run(ctx)(ctx.save_id)


def take_run(ctx: SaveContext) -> Callable[[str], Saved]:
    """:attr:`StateKind.RUN`'s part of an asynchronous save: the generators and the data
    position as of now; the run file and the index's record once the save id is known."""
    comm = ctx.slots.world_comm
    snapshot = snapshot_run(ctx.sampler)
    meta = {META_KEY: index_record(ctx.sampler)}

    def contribution(save_id: str) -> Saved:
        run_file = run_record_bytes(snapshot, save_id, comm.rank, comm.size)
        return Saved(files=[run_file], meta=dict(meta))

    return contribution


def run_file_bytes(save_id: str, rank: int, world_size: int, sampler: Any) -> tuple[str, bytes]:
    """This rank's run record as of now (generators, data position): its name and bytes."""
    return run_record_bytes(snapshot_run(sampler), save_id, rank, world_size)


def run_record_bytes(
    snapshot: RunSnapshot, save_id: str, rank: int, world_size: int
) -> tuple[str, bytes]:
    """The run record of ``snapshot`` (see [Note: run state files]): its name and bytes."""
    payload = {
        "format": RUN_FORMAT,
        "version": RUN_VERSION,
        "save_id": save_id,
        "rank": rank,
        "world_size": world_size,
        "rng": rng_json(snapshot),
        "data": json.loads(snapshot.data_text),
    }
    text = json.dumps({"payload": payload, "sha256": _digest(payload)}, separators=(",", ":"))
    return run_file_name(save_id, rank), text.encode("utf-8")


@dataclass(frozen=True)
class RunRecord:
    rank: int
    streams: Streams
    data: Any
    digest: str
    path: str


def read_run_file(root: str, save_id: str, rank: int) -> RunRecord:
    """Rank ``rank``'s record of the save ``save_id``, verified."""
    path = os.path.join(root, run_file_name(save_id, rank))
    if not os.path.isfile(path):
        raise CheckpointError(f"run state {path}: missing (the index says the save wrote it)")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle, object_pairs_hook=unique_keys(path, CheckpointError))
        payload, digest = raw["payload"], raw["sha256"]
        if not isinstance(payload, dict):
            raise TypeError(f"'payload' is a {type(payload).__name__}, not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"run state {path}: not a run record ({exc!r})") from exc
    if _digest(payload) != digest:
        raise CheckpointError(f"run state {path}: sha256 mismatch (the file is corrupt)")
    for key, want in (("format", RUN_FORMAT), ("version", RUN_VERSION), ("save_id", save_id)):
        if payload.get(key) != want:
            raise CheckpointError(
                f"run state {path}: key {key!r} is {payload.get(key)!r}, expected {want!r}"
            )
    if payload.get("rank") != rank:
        raise CheckpointError(f"run state {path}: key 'rank' is {payload.get('rank')!r}")
    streams = Streams.decode(payload.get("rng"), f"run state {path}")
    return RunRecord(rank, streams, payload.get("data"), digest, path)


# ------------------------------------------------------------------------ load
@dataclass(frozen=True)
class RunRestore:
    """What a loading rank restores once every rank has loaded the checkpoint."""

    own: RunRecord | None  # this rank's saved record, if the rank existed
    base: RunRecord | None  # rank 0's record when needed: the seed of ranks that did not exist

    def restore_rng(self, rank: int) -> None:
        if self.own is not None:
            self.own.streams.restore()
        else:
            derive_rng(self.base.digest, rank)


def read_for_load(
    root: str, meta: dict[str, Any], rank: int, world_size: int, sampler: Any
) -> tuple[RunRestore | None, Any]:
    """This rank's run records, and the data position for ``sampler`` (checked, not set)."""
    record = meta.get(META_KEY)
    where = f"checkpoint {os.path.join(root, 'index.json')}"
    if record is None:
        if sampler is not None:
            raise CheckpointError(f"{where}: no data position (saved before run state existed)")
        return None, None
    if not isinstance(record, dict) or record.get("version") != RUN_VERSION:
        raise CheckpointError(f"{where}: key {META_KEY!r} is malformed: {record!r}")
    saved_world = meta.get("world_size")
    if not isinstance(saved_world, int) or saved_world < 1:
        raise CheckpointError(f"{where}: key 'world_size' is {saved_world!r}")
    save_id = str(meta.get("save_id"))
    own = read_run_file(root, save_id, rank) if rank < saved_world else None
    base = own if rank == 0 else None
    if base is None and (own is None or saved_world != world_size):
        base = read_run_file(root, save_id, 0)
    data_record = own if saved_world == world_size else base
    if sampler is not None and data_record.data is None:
        raise CheckpointError(
            f"run state {data_record.path}: key 'data' is null (saved without sampler=)"
        )
    return RunRestore(own, base), data_record.data


class RunLoad(KindLoad):
    """:attr:`StateKind.RUN`'s load: the data position on trial at the check (put back if
    any rank fails), the random streams once every rank has loaded."""

    def __init__(self) -> None:
        self.restore: RunRestore | None = None  # what restores the random streams, at the end
        self.data: Any = None  # the sampler's saved position
        self.before: Any = None  # the sampler's state before the trial, to put back

    def check(self, ctx: LoadContext) -> list[PlannedRead]:
        if not ctx.restore_rng and ctx.sampler is None:
            return []
        comm = ctx.slots.world_comm
        restore, self.data = read_for_load(
            ctx.root, ctx.index.meta, comm.rank, comm.size, ctx.sampler
        )
        self.restore = restore if ctx.restore_rng else None
        return []

    def trial(self, ctx: LoadContext) -> None:
        if ctx.sampler is not None and callable(getattr(ctx.sampler, "state_dict", None)):
            self.before = ctx.sampler.state_dict()
            ctx.sampler.load_state_dict(self.data)

    def undo(self, ctx: LoadContext) -> None:
        if self.before is not None:
            ctx.sampler.load_state_dict(self.before)

    def copy(self, ctx: LoadContext) -> None:
        if ctx.sampler is not None and self.before is None:  # no state_dict(): set it now
            ctx.sampler.load_state_dict(self.data)

    def finish(self, ctx: LoadContext) -> None:
        if self.restore is not None:
            self.restore.restore_rng(ctx.slots.world_comm.rank)
