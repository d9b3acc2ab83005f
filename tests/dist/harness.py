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

Between tests each rank puts back what a fresh process would have (see ``_Task``):
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
import ctypes
import gc
import os
import queue as queue_module
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
        POOL_EVENTS.append(f"world {world_size}: replaced after {_fn_name(fn)} failed")
        _drop_pool(world_size)
        raise
    if dirty:
        POOL_EVENTS.append(f"world {world_size}: replaced after {_fn_name(fn)}: {dirty}")
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


# --------------------------------------------------------------------------- fresh ranks


def _entry(
    rank: int, world_size: int, init_file: str, fn, args, queue, parent_pid: int, environ: dict
) -> None:
    _watch_parent(parent_pid)
    _as_if_spawned(environ)
    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group(
                "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
            )
        except RuntimeError:
            queue.put((rank, False, RENDEZVOUS_FAILED + traceback.format_exc()))
            return
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs, queue, results: dict[int, Any], errors: list[str]) -> None:
    """Wait for every rank's report; stop early on a failure or on a rank that died silently."""
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while len(results) < len(procs):
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [
                i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results
            ]
            if dead:
                errors.append(f"ranks {dead} exited with codes {[procs[i].exitcode for i in dead]}")
                _reports_after_death(procs, queue, results, errors)
                return
            if time.monotonic() > deadline:
                errors.append(f"ranks did not finish within {RANK_TIMEOUT_S}s (hang?)")
                return
            continue
        if not ok:
            errors.append(f"rank {rank}:\n{payload}")
            return
        results[rank] = payload


def _reports_after_death(procs, queue, results: dict[int, Any], errors: list[str]) -> None:
    """The other ranks' reports, for up to :data:`DEATH_GRACE_S`: a loaded machine can take
    seconds to let a rank learn of its peer's death, and that is what a test reads."""
    deadline = time.monotonic() + DEATH_GRACE_S
    while time.monotonic() < deadline:
        running = [i for i, p in enumerate(procs) if p.exitcode is None and i not in results]
        if not running:
            return
        try:
            rank, ok, payload = queue.get(timeout=0.5)
        except queue_module.Empty:
            continue
        if ok:
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")
            return


# [Note: a fresh group that fails to form]
# gloo's full-mesh connect of new ranks sometimes fails with "Connection closed by peer"
# before any of the test's code ran: forked fresh ranks while a pool of the same size
# lives, 3 of 50 calls here (spawned ones: 0 of 12 then, once in test_deepspeed_script.py
# under heavy load before). The cause is not pinned down (gloo's own connect; the
# rendezvous file is new each call). It is the harness's rendezvous, not the test's
# property: such a call starts again on a new rendezvous, up to RENDEZVOUS_ATTEMPTS
# times, and says so in the session's pool events. A failure after the group formed is
# never retried.
RENDEZVOUS_FAILED = "the gloo group of fresh ranks did not form:\n"
RENDEZVOUS_ATTEMPTS = 3


def _run_fresh(fn: Callable[..., Any], world_size: int, args: tuple, ctx) -> list[Any]:
    results, errors = _run_fresh_once(fn, world_size, args, ctx)
    for _ in range(RENDEZVOUS_ATTEMPTS - 1):
        if not (len(errors) == 1 and RENDEZVOUS_FAILED in errors[0]):
            break
        POOL_EVENTS.append(f"fresh ranks of {_fn_name(fn)}: the group did not form; again")
        results, errors = _run_fresh_once(fn, world_size, args, ctx)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _run_fresh_once(
    fn: Callable[..., Any], world_size: int, args: tuple, ctx
) -> tuple[dict[int, Any], list[str]]:
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        environ = dict(os.environ)  # what a spawned child inherits, given to forked ones
        procs = [
            ctx.Process(
                target=_entry,
                args=(r, world_size, init_file, fn, args, queue, os.getpid(), environ),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            _collect(procs, queue, results, errors)
        finally:
            for p in procs:
                p.join(timeout=30 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
        # A rank that reported and then died at exit (an abort in teardown) still fails:
        # a job launcher would call the run failed. [Note: process groups at interpreter exit]
        exits = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if not errors and exits:
            errors.append(f"ranks exited with non-zero codes after reporting: {exits}")
    return results, errors


# ---------------------------------------------------------------------------- the pool

_POOLS: dict[int, _Pool] = {}


def _fn_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


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
                target=_serve,
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
                        ok, payload, unclean = False, "the rank's pipe closed (it died)", []
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


# --------------------------------------------------------------------- in a pooled rank


def _watch_parent(parent_pid: int) -> None:
    """End with pytest (killed, or interrupted before it could end its ranks): the kernel
    sends SIGKILL when the parent goes (Linux), else a thread watches for it.

    A forked pooled rank's parent is the forkserver, which ends when pytest does (its
    pipe from pytest closes): that parent is watched, and pytest must still be there."""
    if os.getppid() != parent_pid:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        parent_pid = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os._exit(3)

        threading.Thread(target=watch, name="shardwrap-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # it went before the signal was asked for
        os._exit(3)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _serve(
    rank: int, world_size: int, init_file: str, conn, parent_pid: int, environ: dict
) -> None:
    _watch_parent(parent_pid)
    _as_if_spawned(environ)
    # Imported before the baseline, not by the first task's clean-up (``_Task`` imports
    # shardwrap): else the sets shardwrap's modules fill at import seem to grow in that task.
    import shardwrap  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    world = dist.group.WORLD
    start = _Baseline(world)
    gc.freeze()  # [Note: frozen between tests]
    conn.send("started")  # Pool.wait_started
    done = 0
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        except BaseException:  # noqa: BLE001 - e.g. the function's module fails to import
            conn.send((False, traceback.format_exc(), []))
            continue
        if task is None:
            break
        fn, args = task
        before = _Task(start)
        try:
            result = fn(rank, world_size, *args)
        except BaseException:  # noqa: BLE001 - report every failure; the pool is replaced
            conn.send((False, traceback.format_exc(), []))
            del fn, args, task
            continue
        del fn, args, task
        done += 1
        unclean = before.restore()
        try:
            unclean += _check_in_step(world, done, world_size)
        except Exception as exc:  # noqa: BLE001
            unclean.append(f"the world group does not work any more: {exc}")
        try:
            conn.send((True, result, unclean))
        except Exception:  # noqa: BLE001 - e.g. a result that does not pickle
            conn.send((False, traceback.format_exc(), []))
        del result
        gc.collect()  # the result's cycles, now that it is sent
        gc.freeze()  # [Note: frozen between tests]
        if unclean:
            break  # the parent replaces this pool
    # No interpreter finalization: its aborts are test_exit's subject, not a pool's concern.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _as_if_spawned(environ: dict) -> None:
    """What a forked rank takes from its server but a spawned one would not: the server's
    environment (the test process's, when the pool starts, is what a child inherits) and
    numpy's global generator (every forked rank would draw the same numbers)."""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


# [Note: frozen between tests]
# ``_Task.restore`` collects garbage after every test, so that the test's models (cycles
# through their hooks) go before the registries are checked. A full collection walks
# every object in the process: with torch, shardwrap, transformers and deepspeed loaded,
# about 0.2 s of CPU per rank and test, the harness's largest cost over a session. So what
# is alive after a test (modules, caches; the test's own objects are gone by then) is
# moved to the collector's permanent generation (``gc.freeze``), and the next test's
# collection walks only what was made since. Reference counting still frees frozen
# objects; only a frozen cycle that becomes garbage later stays, until the pool ends.


def _check_in_step(world, done: int, world_size: int) -> list[str]:
    if not dist.is_initialized() or dist.group.WORLD is not world:
        return ["the default process group was destroyed or replaced"]
    count = torch.tensor([done], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    if int(count) != done:
        return [f"the ranks ran different numbers of tests ({int(count)} != {done})"]
    return []


def _is_setting(name: str, value: Any) -> bool:
    """Module-level upper-case names holding plain values: settings a test may override."""
    bare = name.lstrip("_")
    return bool(bare) and bare.isupper() and isinstance(value, (bool, int, float, str, type(None)))


def _bindings() -> list[tuple[Any, dict[str, Any]]]:
    """Names a test may rebind to patch behaviour, with their values now: settings of
    shardwrap and test modules; functions and classes of shardwrap (``checkpoint.write_stream``);
    torch.distributed's functions and ProcessGroup's methods (a collective counter, a stand-in
    ``init_process_group``). Lazily rebound private state (``posting._executor``) is not one."""
    found = []
    for name, mod in list(sys.modules.items()):
        if mod is None or name == __name__:
            continue
        if name == "shardwrap" or name.startswith("shardwrap."):
            keep = {
                k: v
                for k, v in vars(mod).items()
                if _is_setting(k, v) or isinstance(v, (types.FunctionType, type))
            }
        elif name == "tests" or name.startswith("tests."):
            keep = {k: v for k, v in vars(mod).items() if _is_setting(k, v)}
        elif name in ("torch.distributed", "torch.distributed.distributed_c10d"):
            keep = {k: v for k, v in vars(mod).items() if callable(v)}
        else:
            continue
        found.append((mod, keep))
    found.append((dist.ProcessGroup, dict(vars(dist.ProcessGroup))))
    return found


def _global_hooks() -> dict[str, dict]:
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    hooks = {
        name: getattr(optim_module, name)
        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    }
    for name, value in vars(nn_module).items():
        if name.startswith("_global_") and name.endswith("hooks") and isinstance(value, dict):
            hooks[name] = value
    return hooks


class _Baseline:
    """What a pooled rank looks like right after start-up."""

    def __init__(self, world) -> None:
        self.world = world
        self.dtype = torch.get_default_dtype()


class _Task:
    """A rank's state before a test; ``restore`` puts it back after, listing what it can't."""

    def __init__(self, start: _Baseline) -> None:
        self.start = start
        self.environ = dict(os.environ)
        self.bindings = _bindings()
        self.hooks = {name: set(hooks) for name, hooks in _global_hooks().items()}
        self.threads = set(threading.enumerate())
        self.sets = {
            (name, key): len(value)
            for name, mod in _shardwrap_modules()
            for key, value in vars(mod).items()
            if isinstance(value, set)
        }
        torch.seed()  # a fresh process starts from a random seed of its own

    def restore(self) -> list[str]:
        unclean: list[str] = []
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        for owner, bound in self.bindings:
            now = vars(owner)
            for key, value in bound.items():
                if now.get(key, value) is not value:
                    setattr(owner, key, value)
        torch.set_num_threads(1)
        torch.set_default_dtype(self.start.dtype)
        torch.set_grad_enabled(True)
        if torch.is_anomaly_enabled():
            torch.autograd.set_detect_anomaly(False)
        if torch.are_deterministic_algorithms_enabled():
            torch.use_deterministic_algorithms(False)
        if torch.is_inference_mode_enabled():
            unclean.append("inference mode left on")
        if torch.is_autocast_enabled("cpu"):
            unclean.append("autocast left on")
        self._clear_registries()
        unclean += self._release_groups()
        gc.collect()
        for name, hooks in _global_hooks().items():
            for key in set(hooks) - self.hooks[name]:
                # A closure is for one model; a module-level function (the optimizer-step
                # dispatcher's) removes itself with the last model that needs it.
                if "<locals>" in getattr(hooks[key], "__qualname__", "<locals>"):
                    del hooks[key]
        unclean += self._check_registries()
        unclean += [
            f"thread {t.name!r} left running"
            for t in threading.enumerate()
            if t not in self.threads and t.is_alive() and t.name not in _BENIGN_THREADS
        ]
        return unclean

    def _release_groups(self) -> list[str]:
        if not dist.is_initialized():
            return []
        world = self.start.world
        others = [g for g in list(dist.distributed_c10d._world.pg_map) if g is not world]
        for group in others:
            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # noqa: BLE001
                return [f"could not destroy a process group: {exc}"]
        if others:
            # DTensor caches the output specs of its ops, meshes included, keyed by meshes
            # that compare equal across tests: a new test's mesh would find the last one's,
            # whose groups are gone now.
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()
        return []

    def _clear_registries(self) -> None:
        """Empty shardwrap's module-level weak registries (wrapped modules, live runtimes,
        groups to release at exit, retired parameters, tag counters, ...), as a new process
        would start them. Their entries are this test's: a registry whose value refers to its
        key (``wrap._MANAGED``: unit -> module) keeps the test's models alive until exit,
        with their optimizer hooks."""
        for _, mod in _shardwrap_modules():
            for value in list(vars(mod).values()):
                if isinstance(value, _WEAK_REGISTRIES):
                    value.clear()
        # A new process has warned about nothing yet ([Note: accepted but not acted on]).
        from shardwrap.base.warn_once import forget_warned

        forget_warned()

    def _check_registries(self) -> list[str]:
        unclean = []
        for name, mod in _shardwrap_modules():
            for key, value in list(vars(mod).items()):
                if isinstance(value, _WEAK_REGISTRIES) and len(value):
                    unclean.append(f"{name}.{key} still holds {len(value)} entries")
                elif isinstance(value, set) and len(value) > self.sets.get((name, key), 0):
                    unclean.append(f"{name}.{key} grew to {len(value)} entries")
        return unclean


# Idle threads a library starts once per process: shardwrap's posting helper, tqdm's
# monitor (transformers' downloads and loading bars).
_BENIGN_THREADS = ("shardwrap-post_0", "tqdm_monitor")

_WEAK_REGISTRIES = (weakref.WeakSet, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)


def _shardwrap_modules() -> list[tuple[str, Any]]:
    return [
        (name, mod)
        for name, mod in list(sys.modules.items())
        if mod is not None and (name == "shardwrap" or name.startswith("shardwrap."))
    ]
