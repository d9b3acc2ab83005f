"""Run a function on CPU gloo ranks and collect each rank's result (or its traceback).

[Note: pooled ranks]
Spawning ranks costs seconds per test (each imports torch and shardwrap, then meets the
others), and that dominated the suite's time on 2 cores. So by default ``run_ranks`` runs
``fn`` on a pool of rank processes kept per world size for the whole pytest session:
started lazily, staying in their gloo process group, running one function after another.

For the caller it behaves as spawning did: results by rank; a rank's traceback, a rank
that dies, or a hang past :data:`RANK_TIMEOUT_S` fails the test. After any failure that
pool is killed, and the next test of that world size gets a new one: no test runs on
ranks that may be in the middle of a failed test's collective.

Between tests each rank puts back what a fresh process would have (``_Task`` in
rank_process.py, which holds the code that runs inside the ranks):
environment variables; a new random seed for torch's default generator; one intra-op
thread, the default dtype, grad mode; rebound names (settings, functions and classes of
shardwrap, upper-case settings of test modules, torch.distributed's functions and
ProcessGroup's methods); global optimizer and module hooks made for one model; process
groups other than the world's; and shardwrap's module-level weak registries, which it
empties (``wrap._MANAGED`` maps each unit to its module, so without that every wrapped
model stays alive, optimizer hooks included, until the process ends). Then it checks
that no registry filled again, that no new thread runs, that the world group is the one
it started with, and that every rank ran as many tests. A rank that is not clean says so,
and the pool is replaced after that test (which still passes); the terminal summary
lists every replacement.

A test that needs processes of its own (it checks process exit or a killed rank, runs its
own ``init_process_group``, reads environment variables at import, ...) says so with
``@pytest.mark.fresh_ranks`` or ``run_ranks(..., fresh=True)`` and gets new processes,
as before the pool. ``SHARDWRAP_FRESH_RANKS=1`` does that for every test.

[Note: pooled ranks are forked]
Even pooled, each rank used to import torch, shardwrap and the tests' libraries on its own
(seconds of CPU each, ~18 ranks a session plus every replaced pool, 8 at once for the 3-D
module). So pooled ranks come from a forkserver (``_pool_context``) that imports those
once, before any rank exists, and forks every pooled rank from that state. Forking is safe
there: the server runs no torch op, starts no thread of its own and joins no process group
(gloo groups are made after the fork, in the rank), and each rank sets its own environment
(the test process's at the pool's start, as a spawned child would inherit it) and reseeds
numpy's global generator (fork copies it; ``random`` reseeds itself). A pooled rank ends
with ``os._exit`` either way, so what a forked process skips at exit (interpreter
finalization) was never a pool's to check. Fresh ranks (``fresh=True``, the
``fresh_ranks`` marker) are forked from the same server: new processes that ran no earlier
test, without the seconds of imports a spawn costs (24 spawns a suite, about 4 s of CPU
each, before). Only a test of what happens at interpreter exit, which a forked process
skips, needs ``spawned=True`` (the ``spawned_ranks`` marker): new interpreters.
``SHARDWRAP_SPAWN_POOLS=1`` spawns pooled and fresh ranks too.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for
from typing import Any

import torch.multiprocessing as mp

from .fresh_ranks import fn_name, run_fresh
from .rank_process import serve

# The sharding strategies every parity-style test runs, and the world sizes it runs them at.
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM", "NO_SHARD")
WORLD_SIZES = (1, 2, 3)
MULTI_RANK_WORLD_SIZES = (2, 3)  # for what one rank cannot show (traffic, sharding)

RANK_TIMEOUT_S = 120.0  # generous for 2 loaded CPU cores; a hang fails instead of blocking CI
# A new pool's ranks import torch (and what the tests' modules import) and meet in their
# gloo group before the first test runs on them: a minute and more for 8 ranks on 2 slow,
# loaded cores. That is start-up, not a hang, so it has its own, longer limit, and a
# test's RANK_TIMEOUT_S starts when its function is handed to ranks that are ready.
RANK_START_TIMEOUT_S = 600.0
DEATH_GRACE_S = 10.0  # after a rank dies, how long the others may take to report why they fail

# Set for one test by the ``fresh_ranks`` marker (tests/conftest.py).
FRESH_RANKS = os.environ.get("SHARDWRAP_FRESH_RANKS", "") not in ("", "0")
# Set for one test by the ``spawned_ranks`` marker: fresh ranks in new interpreters.
SPAWNED_RANKS = False
# Pooled ranks spawned instead of forked from a preloaded server ([Note: pooled ranks are forked]).
SPAWN_POOLS = os.environ.get("SHARDWRAP_SPAWN_POOLS", "") not in ("", "0")
# What the forkserver imports once for every pooled rank: torch, shardwrap, and the heavy
# libraries the tests' rank functions import (a missing one is skipped by the server).
POOL_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.multiprocessing",
    "numpy",
    "numpy.random",  # numpy imports it lazily; its global generator is what ranks reseed
    "pytest",
    "shardwrap",
    "tests.dist.harness",
    "transformers",
)

# What happened to the pools this session, for the terminal summary.
POOL_EVENTS: list[str] = []


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    fresh: bool = False,
    spawned: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank.

    ``fresh``: on new processes instead of the session's pool ([Note: pooled ranks]),
    forked from the preloaded server; ``spawned``: new interpreters, for a test of what
    happens at interpreter exit ([Note: pooled ranks are forked]).
    """
    if spawned or SPAWNED_RANKS:
        return _run_fresh(fn, world_size, args, mp.get_context("spawn"))
    if fresh or FRESH_RANKS:
        return _run_fresh(fn, world_size, args, _pool_context())
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.alive():
        POOL_EVENTS.append(f"world {world_size}: a rank had died between tests; replaced")
        _drop_pool(world_size)
        pool = None
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        results, dirty = pool.run(fn, args)
    except BaseException:
        POOL_EVENTS.append(f"world {world_size}: replaced after {fn_name(fn)} failed")
        _drop_pool(world_size)
        raise
    if dirty:
        POOL_EVENTS.append(f"world {world_size}: replaced after {fn_name(fn)}: {dirty}")
        _drop_pool(world_size, graceful=True)
    return results


def release_pool(world_size: int) -> None:
    """End the pool of ``world_size`` ranks now, for a world size one module alone uses
    (its idle processes would otherwise hold memory until the session ends)."""
    _drop_pool(world_size, graceful=True)


def shutdown_pools() -> None:
    """End every pooled rank (at the end of the session; also registered with atexit), then
    the forkserver they came from, waited for: a server left to end by itself (when this
    process goes) would take its ranks' CPU time out of what ``time make test`` reports."""
    for world_size in list(_POOLS):
        _drop_pool(world_size, graceful=True)
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # private: 3.8 to 3.13 have it
    if stop is not None:
        stop()  # nothing when no server runs; a later pool starts a new one


def _run_fresh(fn: Callable[..., Any], world_size: int, args: tuple, ctx) -> list[Any]:
    return run_fresh(fn, world_size, args, ctx, (RANK_TIMEOUT_S, DEATH_GRACE_S), POOL_EVENTS)


# ---------------------------------------------------------------------------- the pool

_POOLS: dict[int, _Pool] = {}


def _drop_pool(world_size: int, graceful: bool = False) -> None:
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close(graceful)


def _pool_context():
    """Where pooled ranks come from: a forkserver with :data:`POOL_PRELOAD` imported, or
    plain spawn ([Note: pooled ranks are forked])."""
    if SPAWN_POOLS:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Once per process: the server starts with the first pool and keeps this list.
    ctx.set_forkserver_preload(list(POOL_PRELOAD))
    return ctx


class _Pool:
    """``world_size`` rank processes in one gloo group, each serving tasks over a pipe."""

    def __init__(self, world_size: int) -> None:
        ctx = _pool_context()
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix=f"shardwrap-ranks{world_size}-")
        init_file = os.path.join(self.tmp, "rendezvous")
        self.conns = []
        self.procs = []
        self.started = False  # every rank said it is in the group and waits for tasks
        for rank in range(world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=serve,
                args=(rank, world_size, init_file, theirs, os.getpid(), dict(os.environ)),
                name=f"shardwrap-rank{rank}-of-{world_size}",
            )
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        POOL_EVENTS.append(f"world {world_size}: started")
        _register_atexit()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def wait_started(self) -> None:
        """Wait (up to RANK_START_TIMEOUT_S) for every rank's word that it is ready."""
        deadline = time.monotonic() + RANK_START_TIMEOUT_S
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        while waiting:
            sentinels = {self.procs[rank].sentinel: rank for rank in waiting.values()}
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"ranks {sorted(waiting.values())} of a new pool of {self.world_size} "
                    f"did not start within {RANK_START_TIMEOUT_S}s"
                )
            for handle in wait_for([*waiting, *sentinels], timeout=min(left, 5.0)):
                if handle in waiting:
                    try:
                        handle.recv()
                    except EOFError:
                        continue  # it died: its sentinel says so
                    del waiting[handle]
                elif sentinels[handle] in waiting.values():
                    rank = sentinels[handle]
                    self.procs[rank].join(timeout=1.0)
                    raise AssertionError(
                        f"rank {rank} of a new pool exited with code "
                        f"{self.procs[rank].exitcode} while starting"
                    )
        self.started = True

    def run(self, fn: Callable[..., Any], args: tuple) -> tuple[list[Any], list[str]]:
        if not self.started:
            self.wait_started()
        # One pickling per rank: a tensor argument is shared through a file descriptor that
        # each pickled copy hands over once.
        for conn in self.conns:
            conn.send((fn, args))
        results: dict[int, Any] = {}
        dirty: list[str] = []
        deadline = time.monotonic() + RANK_TIMEOUT_S
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        while waiting:
            # A rank that reported may end (when it left its state unclean): only the
            # ranks still running are watched for death.
            sentinels = {self.procs[rank].sentinel: rank for rank in waiting.values()}
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"ranks {sorted(waiting.values())} did not finish within "
                    f"{RANK_TIMEOUT_S}s (hang?)"
                )
            ready = wait_for([*waiting, *sentinels], timeout=min(left, 5.0))
            for handle in ready:
                if handle in waiting:
                    rank = waiting.pop(handle)
                    try:
                        ok, payload, unclean = handle.recv()
                    except EOFError:
                        ok, payload, unclean = False, self._death(rank), []
                    if not ok:
                        raise AssertionError(self._errors_with(rank, payload, waiting))
                    results[rank] = payload
                    dirty += [f"rank {rank}: {reason}" for reason in unclean]
            for handle in ready:
                rank = sentinels.get(handle, -1)
                if rank >= 0 and self.conns[rank] in waiting:
                    if self.conns[rank].poll():
                        continue  # its report came with its end; read it first
                    self.procs[rank].join(timeout=1.0)
                    code = self.procs[rank].exitcode
                    error = f"ranks [{rank}] exited with codes [{code}]"
                    del waiting[self.conns[rank]]
                    raise AssertionError(self._errors_with(rank, error, waiting))
        return [results[r] for r in range(self.world_size)], dirty

    def _death(self, rank: int) -> str:
        """Why ``rank``'s pipe closed mid-test: its exit code says how it ended (a signal's
        negative number: -11 a crash, -9 killed, as by the kernel's out-of-memory killer)."""
        self.procs[rank].join(timeout=5.0)
        code = self.procs[rank].exitcode
        # Worded as a death seen by the process's end, so _errors_with waits as long for
        # the others' reports.
        return f"ranks [{rank}] exited with codes [{code}] (its pipe closed mid-test)"

    def _errors_with(self, rank: int, payload: str, waiting: dict) -> str:
        """The first failure, with the failures of ranks that report soon after (within a
        second, or :data:`DEATH_GRACE_S` after a death)."""
        died = payload.startswith("ranks [")
        errors = [payload if died else f"rank {rank}:\n{payload}"]
        deadline = time.monotonic() + (DEATH_GRACE_S if died else 1.0)
        while waiting and time.monotonic() < deadline:
            for handle in wait_for(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
                other = waiting.pop(handle)
                try:
                    ok, payload, _ = handle.recv()
                except EOFError:
                    continue
                if not ok:
                    errors.append(f"rank {other}:\n{payload}")
        return "\n".join(errors)

    def close(self, graceful: bool) -> None:
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            deadline = time.monotonic() + 10.0
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


_atexit_registered = False


def _register_atexit() -> None:
    # Registered after multiprocessing's own exit handler, so it runs first: that one joins
    # non-daemonic children, which pooled ranks would never be without this.
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown_pools)
        _atexit_registered = True
