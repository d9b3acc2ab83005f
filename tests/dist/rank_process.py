"""What runs inside a rank process the harness starts (tests/dist/harness.py): the entry
of a fresh rank, the task loop of a pooled one, and what a pooled rank puts back between
tests ([Note: pooled ranks] in harness.py says what and why).
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import threading
import time
import traceback
import types
import weakref
from typing import Any

import torch
import torch.distributed as dist

# What a fresh rank reports when its gloo group did not form ([Note: a fresh group that
# fails to form] in fresh_ranks.py).
RENDEZVOUS_FAILED = "the gloo group of fresh ranks did not form:\n"


def fresh_entry(
    rank: int, world_size: int, init_file: str, fn, args, queue, parent_pid: int, environ: dict
) -> None:
    """A fresh rank: join the group, run ``fn`` once, report on ``queue``."""
    _watch_parent(parent_pid)
    as_if_spawned(environ)
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


def serve(rank: int, world_size: int, init_file: str, conn, parent_pid: int, environ: dict) -> None:
    """A pooled rank: join the group, then run the tasks ``conn`` sends until told to stop."""
    _watch_parent(parent_pid)
    as_if_spawned(environ)
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
    conn.send("started")  # harness._Pool.wait_started
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


def as_if_spawned(environ: dict) -> None:
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
        if mod is None or name in (__name__, "tests.dist.harness"):
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
