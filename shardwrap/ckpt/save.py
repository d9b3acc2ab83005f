"""``save_checkpoint``: every rank writes what it owns, then world rank 0 commits the index.

Each rank stages what every state kind saves ([Note: state kinds] in piece_records.py; the
table in kinds.py): pieces for its safetensors file (read lazily while writing, or copied
to host buffers first for an asynchronous save), files of its own (the run state's) and
header records. It writes them, then reports (:class:`~.piece_records.RankReport`, as JSON) to
world rank 0, which commits the index (commit.py) once every rank's files are durable.

Every rank reports success or its error to all others before anyone goes on, so a failure
on one rank raises on all of them instead of leaving the rest waiting in a collective.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..base.gc_pause import gc_paused
from ..base.validate import check_bool
from ..comm.collectives import Communicator
from . import async_save, fragments, run_state
from .async_save import AsyncSave
from .commit import commit_index
from .format import CheckpointError, FileEntry, read_index, shard_file_name, write_atomic
from .kinds import save_all, take_all
from .outcome import Outcome, agree_on_id, check_json, guarded, json_snapshot, settle
from .piece_records import RankReport, SaveContext, Saved, SentFragment
from .safetensors_writer import write_stream
from .slots import ModelSlots, model_slots, world_communicator
from .staging_plan import StagingPlan


def save_checkpoint(
    path: str | os.PathLike,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Any = None,
    sampler: Any = None,
    asynchronous: bool = False,
    on_commit: Callable[[], None] | None = None,
    after_save: Callable[[Communicator], None] | None = None,
) -> AsyncSave | None:
    """Save ``model`` (and ``optimizer``) to the folder ``path``; call on every rank.

    ``extra`` is any JSON value (step, epoch, scheduler state); it comes back from
    :func:`load_checkpoint`. Every rank also records its random number generators and
    ``sampler.state_dict()`` (the data position, e.g. of a
    :class:`~shardwrap.data.sampler.ResumableSampler`) in a small file of its own
    ([Note: run state files]). The checkpoint becomes visible only once complete.

    With ``asynchronous`` (the same on every rank), the state is copied into host buffers
    and an :class:`~shardwrap.ckpt.async_save.AsyncSave` is returned at once; its files are
    written, hashed and committed in the background, and ``result()`` raises any failure
    ([Note: asynchronous saves]). Any save first waits for the model's save in flight.
    ``on_commit`` runs on world rank 0 once the index is written, before any rank learns
    that the save succeeded (its failure fails the save). ``after_save(comm)`` runs on
    every rank once every rank has learnt that the save succeeded, on the caller's thread
    or the background thread, with the group the save ran on (``comm``; an asynchronous
    save's own): its failure fails the save, and it settles its own collectives' failures
    across ranks (the memory tier's peer copy: ckpt/tiered_save.py).
    """
    check_bool("asynchronous", asynchronous)
    for name, hook in (("on_commit", on_commit), ("after_save", after_save)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{name}: expected a callable, got {type(hook).__name__}")
    root = os.fspath(path)
    if asynchronous:
        return _save_in_background(root, model, optimizer, extra, sampler, on_commit, after_save)
    slots = model_slots(model)
    comm = slots.world_comm
    async_save.wait_for_previous(model)

    def open_save() -> None:
        run_state.check_sampler("sampler", sampler, "state_dict")
        check_json("extra", extra)

    # One all-reduce agrees on rank 0's save id and on whether every rank may go on.
    opening = guarded(open_save)
    save_id, failures = agree_on_id(comm, opening.error is not None)
    settle(comm, "save", root, opening.error, failures=failures)
    staged = guarded(lambda: _stage_rank(SaveContext(save_id, slots, optimizer, sampler)))
    job = SaveJob(root, save_id, slots, optimizer, extra, on_commit, after_save)
    _finish_save(job, staged, comm)
    return None


@dataclass(frozen=True, slots=True)
class Staged:
    """What this rank saves, as of the call."""

    saved: Saved  # every state kind's pieces, files of its own and header records
    fragment: SentFragment  # its description of the model ([Note: checkpoints of pipeline stages])


@dataclass(frozen=True, slots=True)
class SaveJob:
    """What the end of a save needs besides the staged state."""

    root: str
    save_id: str
    slots: ModelSlots
    optimizer: torch.optim.Optimizer | None
    extra: Any  # JSON, as of the call
    on_commit: Callable[[], None] | None
    after_save: Callable[[Communicator], None] | None


def _stage_rank(ctx: SaveContext) -> Staged:
    """What this rank saves, as of now: its pieces (read lazily while writing), their
    records, its own files and its fragment."""
    saved = save_all(ctx)
    return Staged(saved, fragments.to_send(ctx.slots, fragments.fragment(ctx.slots, ctx.optimizer)))


# ------------------------------------------------------------- asynchronous saves
@dataclass(frozen=True, slots=True)
class Taken:
    """What an asynchronous save takes on the caller's thread ([Note: asynchronous saves])."""

    plan: StagingPlan  # its items read the staged copies
    slots: ModelSlots  # the model's, as of the call (the plan keeps none: see its note)
    contributions: Callable[[str], Saved]  # the other kinds' (the run state), given the id
    extra: Any  # JSON, as of the call
    groups: list[dict[str, Any]] | None  # the param groups' settings, as of the call
    values: list[Any]  # the optimizer state that is a JSON value (the plan's sites)


def _save_in_background(
    root: str, model: Any, optimizer, extra: Any, sampler: Any, on_commit, after_save
) -> AsyncSave:
    """Stage now, on the caller's thread; agree, write and commit on the saver's."""
    world_comm = world_communicator(model)
    async_save.wait_for_previous(model)
    saver = async_save.saver_of(model, world_comm)  # its first call makes the group
    taken = guarded(lambda: _take(saver, model, optimizer, extra, sampler))
    finish = functools.partial(_finish_in_background, root, optimizer, taken, on_commit, after_save)
    return saver.start(root, finish)


def _take(saver: async_save.AsyncSaver, model: Any, optimizer, extra: Any, sampler: Any) -> Taken:
    run_state.check_sampler("sampler", sampler, "state_dict")
    extra = json_snapshot("extra", extra)
    slots = model_slots(model)
    plan = saver.stage(model, optimizer, slots)
    groups, values = plan.values_now(optimizer)
    contributions = take_all(SaveContext("", slots, optimizer, sampler))
    return Taken(plan, slots, contributions, extra, groups, values)


def _finish_in_background(
    root: str, optimizer, taken: Outcome[Taken], on_commit, after_save, comm: Communicator
) -> None:
    """The saver's thread: one all-reduce agrees on the save id and on whether every rank
    staged, then as a synchronous save from the write on."""
    save_id, failures = agree_on_id(comm, taken.error is not None)
    settle(comm, "save", root, taken.error, failures=failures)
    assert taken.value is not None  # no rank failed
    value = taken.value
    staged = guarded(lambda: _staged_from(value, save_id))
    job = SaveJob(root, save_id, value.slots, optimizer, value.extra, on_commit, after_save)
    _finish_save(job, staged, comm)


def _staged_from(taken: Taken, save_id: str) -> Staged:
    """The staged state of ``taken`` as a save of ``save_id`` writes it."""
    plan = taken.plan
    saved = Saved(list(plan.items), list(plan.records))
    saved.add(taken.contributions(save_id))  # the kinds after the tensor kinds, in order
    fragment = plan.fragment_with(taken.groups, taken.values)
    return Staged(saved, fragments.to_send(taken.slots, fragment))


def _finish_save(job: SaveJob, staged: Outcome[Staged], comm: Communicator) -> None:
    """Write this rank's files, gather the reports on ``comm``, commit on its rank 0."""
    rank = job.slots.world_comm.rank
    report = RankReport(staged.error)
    if staged.value is not None:
        written = guarded(lambda: _write_rank_files(job.root, job.save_id, rank, staged.value))
        report = written.value or RankReport(written.error)
    names = [report.file] + ([n for n, _ in staged.value.saved.files] if staged.value else [])
    undo = lambda: _drop_uncommitted(job.root, job.save_id, names)  # noqa: E731
    # Only rank 0 receives the ranks' records (a gather, as JSON values):
    # docs/checkpoint-format.md.
    gathered = comm.gather_object(report.to_json(), purpose="checkpoint")
    error = report.error
    if comm.rank == 0:
        with gc_paused():  # millions of pieces at scale: see base/gc_pause.py
            error = _commit_unless_failed(job, gathered, staged.value)
    settle(comm, "save", job.root, error, undo)
    if job.after_save is not None:
        job.after_save(comm)


def _commit_unless_failed(job: SaveJob, gathered: list, own: Staged | None) -> str | None:
    """World rank 0: the ranks' errors, or the index written (and its error, if any)."""
    parsed = guarded(lambda: [RankReport.from_json(r, raw) for r, raw in enumerate(gathered)])
    if parsed.value is None:
        return parsed.error
    failed = [(rank, r.error) for rank, r in enumerate(parsed.value) if r.error]
    if failed:
        return "; ".join(f"rank {rank}: {error}" for rank, error in failed)
    assert own is not None  # rank 0's own report did not fail
    reports, meta = parsed.value, own.saved.meta

    def commit() -> None:
        commit_index(job.root, job.save_id, job.slots, job.optimizer, reports, job.extra, meta)
        if job.on_commit is not None:
            job.on_commit()

    return guarded(commit).error


def _drop_uncommitted(root: str, save_id: str, names: list[str | None]) -> None:
    """After a failed save: remove this rank's new files unless the index already names them."""
    try:
        committed = read_index(root).meta.get("save_id")
    except (OSError, CheckpointError):
        committed = None
    if committed != save_id:
        for name in filter(None, names):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(root, name))


def _write_rank_files(root: str, save_id: str, rank: int, staged: Staged) -> RankReport:
    """This rank's safetensors file and its own files, durably; its report."""
    os.makedirs(root, exist_ok=True)
    saved = staged.saved
    name = entry = None
    if saved.items:
        name = shard_file_name(save_id, rank)
        meta = {"format": "pt", "save_id": save_id}
        written = write_stream(os.path.join(root, name), saved.items, meta)
        entry = FileEntry(written.size, written.sha256, written.chunk_bytes, written.chunk_sha256)
    for file_name, data in saved.files:
        write_atomic(root, file_name, data)
    return RankReport(None, name, entry, tuple(saved.records), staged.fragment)
