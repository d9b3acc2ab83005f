"""The rank pool behind run_ranks: failures, hangs, and state that must not reach the next test."""

from __future__ import annotations

import os
import time
import uuid
import weakref

import pytest
import torch
import torch.distributed as dist

from tests.dist import fresh_ranks, harness, rank_process
from tests.dist.harness import run_ranks

_PROCESS = uuid.uuid4().hex  # made anew in every process that imports this module


def _pid(rank: int, world_size: int) -> str:
    return f"{os.getpid()}-{_PROCESS}"


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 waits for a partner that never comes


def _hang(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _dirty(rank: int, world_size: int) -> None:
    os.environ["SHARDWRAP_HARNESS_TEST"] = "1"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    torch.manual_seed(1234)
    dist.new_group([0, 1])

    def patched(*args, **kwargs):
        raise AssertionError("a patch from an earlier test")

    dist.all_reduce = patched


def _state(rank: int, world_size: int) -> dict:
    return {
        "env": os.environ.get("SHARDWRAP_HARNESS_TEST"),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "seeded_by_the_last_test": torch.initial_seed() == 1234,
        "groups": len(dist.distributed_c10d._world.pg_map),
        "all_reduce": dist.all_reduce.__name__,
    }


def _destroy_world(rank: int, world_size: int) -> None:
    dist.destroy_process_group()


def test_ranks_are_reused_and_fresh_ones_are_not() -> None:
    assert run_ranks(_pid, 2) == run_ranks(_pid, 2)
    fresh = run_ranks(_pid, 2, fresh=True)
    assert set(fresh).isdisjoint(run_ranks(_pid, 2))


@pytest.mark.fresh_ranks
def test_marker_spawns_fresh_ranks() -> None:
    assert run_ranks(_pid, 2) != run_ranks(_pid, 2)


def _parent_pid(rank: int, world_size: int) -> int:
    return os.getppid()


def test_fresh_ranks_are_forked_and_spawned_ones_are_new_interpreters() -> None:
    """A forked fresh rank's parent is the preloaded server, a spawned one's this process
    (test_exit.py's checks at interpreter exit need the latter: run on forked ranks, its
    exit handlers never ran and the test failed on the missing reports, seen once)."""
    assert set(run_ranks(_parent_pid, 2, spawned=True)) == {os.getpid()}
    assert os.getpid() not in run_ranks(_parent_pid, 2, fresh=True)


def test_failure_surfaces_and_pool_is_replaced() -> None:
    before = run_ranks(_pid, 2)
    with pytest.raises(AssertionError, match="rank 1 gives up"):
        run_ranks(_fail_on_rank_1, 2)
    after = run_ranks(_pid, 2)
    assert set(before).isdisjoint(after)


def _exit_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        # Its pipe closes first (every descriptor past stderr, the gloo sockets too), and
        # only then the process ends (by gloo's abort on its closed sockets, -6, or with
        # 7): the harness sees the closed pipe before the exit.
        os.closerange(3, 65536)
        time.sleep(1.0)
        os._exit(7)
    # Rank 0 waits without the group: in a collective with rank 1 its own error ("closed
    # by peer") could reach the harness before rank 1's closed pipe (seen once, throttled).
    time.sleep(3.0)


def test_a_rank_whose_pipe_closes_is_named_with_its_exit_code() -> None:
    """The harness reads a closed pipe before the process's end here; the error still
    names the rank and how it ended (a crash's signal, an out-of-memory kill). Control
    (run once): the old message, "the rank's pipe closed (it died)", fails it."""
    with pytest.raises(AssertionError, match=r"ranks \[1\] exited with codes \[-?\d+\] \(its pipe"):
        run_ranks(_exit_on_rank_1, 2)


def test_hang_times_out_and_pool_is_replaced(monkeypatch) -> None:
    before = run_ranks(_pid, 2)
    monkeypatch.setattr(harness, "RANK_TIMEOUT_S", 3.0)
    with pytest.raises(AssertionError, match="did not finish within"):
        run_ranks(_hang, 2)
    monkeypatch.undo()
    assert set(before).isdisjoint(run_ranks(_pid, 2))


def test_state_does_not_leak_into_the_next_test() -> None:
    clean = run_ranks(_state, 2)
    run_ranks(_dirty, 2)
    assert run_ranks(_state, 2) == clean


def test_destroyed_world_group_means_new_ranks() -> None:
    before = run_ranks(_pid, 2)
    run_ranks(_destroy_world, 2)
    assert set(before).isdisjoint(run_ranks(_pid, 2))


def _numpy_draw(rank: int, world_size: int) -> float:
    import numpy

    return float(numpy.random.random())


def _environ(rank: int, world_size: int) -> str | None:
    return os.environ.get("SHARDWRAP_HARNESS_POOL_ENV")


def _parent(rank: int, world_size: int) -> int:
    return os.getppid()


def test_pooled_ranks_are_forked_yet_start_as_spawned_ones_would(monkeypatch) -> None:
    """[Note: pooled ranks are forked]: pooled ranks come from the preloaded server (not
    from this process), yet each takes this process's environment at the pool's start and
    draws its own numpy numbers. Negative controls: without ``_as_if_spawned`` both ranks
    draw the same number and miss the variable set after the server started."""
    if harness.SPAWN_POOLS:
        pytest.skip("SHARDWRAP_SPAWN_POOLS=1: pooled ranks are spawned")
    run_ranks(_pid, 2)  # the server runs (started by this pool or an earlier one)
    monkeypatch.setenv("SHARDWRAP_HARNESS_POOL_ENV", "set after the server started")
    harness.release_pool(2)
    try:
        parents = run_ranks(_parent, 2)
        assert os.getpid() not in parents and len(set(parents)) == 1, parents
        assert run_ranks(_environ, 2) == ["set after the server started"] * 2
        first, second = run_ranks(_numpy_draw, 2)
        assert first != second
    finally:
        harness.release_pool(2)  # the next pool starts with this process's usual environment


_left_behind = None  # a weak reference to the last test's model, in the rank


def _leave_a_cycle(rank: int, world_size: int) -> None:
    global _left_behind
    model = torch.nn.Linear(2, 2)
    model.register_forward_hook(lambda module, args, out: module)  # a cycle, as a wrap's
    model.me = [model]
    _left_behind = weakref.ref(model)


def _cycle_collected(rank: int, world_size: int) -> bool:
    return _left_behind is not None and _left_behind() is None


def test_a_tests_cycles_are_collected_before_the_next_test() -> None:
    """[Note: frozen between tests]: what a test leaves in cycles is collected, not frozen
    with what lives on. Negative control: ``gc.freeze()`` before the collection in
    ``_Task.restore`` keeps the last test's model alive and fails this test."""
    run_ranks(_leave_a_cycle, 2)
    assert run_ranks(_cycle_collected, 2) == [True, True]


def test_fresh_ranks_start_again_only_when_their_group_did_not_form(monkeypatch) -> None:
    """[Note: a fresh group that fails to form]: another start after a rendezvous failure,
    none after a failure of the test's code (the control: that error is raised at once),
    and no more than ``RENDEZVOUS_ATTEMPTS`` in all."""
    attempts: list[str] = []

    def once(outcomes):
        def fake(fn, world_size, args, ctx, limits):
            attempts.append("start")
            return outcomes[len(attempts) - 1]

        return fake

    formed = ({0: "a", 1: "b"}, [])
    not_formed = ({}, [f"rank 1:\n{rank_process.RENDEZVOUS_FAILED}RuntimeError: connectFullMesh"])
    monkeypatch.setattr(fresh_ranks, "run_fresh_once", once([not_formed, formed]))
    events: list[str] = []
    limits = (harness.RANK_TIMEOUT_S, harness.DEATH_GRACE_S)
    assert fresh_ranks.run_fresh(_pid, 2, (), None, limits, events) == ["a", "b"]
    assert len(attempts) == 2
    assert events == [f"fresh ranks of {__name__}._pid: the group did not form; again"]
    attempts.clear()
    failed = ({}, ["rank 0:\nAssertionError: the test's own failure"])
    monkeypatch.setattr(fresh_ranks, "run_fresh_once", once([failed, formed]))
    with pytest.raises(AssertionError, match="the test's own failure"):
        fresh_ranks.run_fresh(_pid, 2, (), None, limits, [])
    assert len(attempts) == 1
    attempts.clear()
    monkeypatch.setattr(fresh_ranks, "run_fresh_once", once([not_formed] * 5))
    with pytest.raises(AssertionError, match="did not form"):
        fresh_ranks.run_fresh(_pid, 2, (), None, limits, [])
    assert len(attempts) == fresh_ranks.RENDEZVOUS_ATTEMPTS
