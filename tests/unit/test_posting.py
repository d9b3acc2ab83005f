"""The helper thread that posts pairwise sends and receives (no process group)."""

from __future__ import annotations

import os
import threading

import pytest

from shardwrap.comm import posting


def test_posts_run_off_the_caller_thread_in_order() -> None:
    seen: list[tuple[int, str]] = []
    release = threading.Event()

    def first() -> list[int]:
        release.wait(timeout=10)  # later posts queue behind this one
        seen.append((1, threading.current_thread().name))
        return [1]

    def second() -> list[int]:
        seen.append((2, threading.current_thread().name))
        return [2]

    futures = [posting.post(first), posting.post(second)]
    release.set()
    assert [f.result(timeout=10) for f in futures] == [[1], [2]]
    assert [index for index, _ in seen] == [1, 2]
    assert all(name.startswith("shardwrap-post") for _, name in seen)
    assert threading.current_thread().name not in {name for _, name in seen}


def test_a_failed_post_raises_at_its_result() -> None:
    def broken() -> list[int]:
        raise RuntimeError("peer 3 closed the connection")

    future = posting.post(broken)
    with pytest.raises(RuntimeError, match="peer 3"):
        future.result(timeout=10)
    assert posting.post(lambda: [7]).result(timeout=10) == [7]  # the helper lives on


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_posts_through_its_own_helper() -> None:
    assert posting.post(lambda: [0]).result(timeout=10) == [0]  # the parent's helper exists
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's thread is gone; a post must not wait for it forever
        try:
            ok = posting.post(lambda: [threading.get_ident()]).result(timeout=10)
            os.write(write_end, b"ok" if ok else b"empty")
        except BaseException:
            os.write(write_end, b"failed")
        finally:
            os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    assert os.read(read_end, 16) == b"ok"
    os.close(read_end)
    assert status == 0


def test_without_the_helper_posts_run_on_the_caller_thread(monkeypatch) -> None:
    monkeypatch.setattr(posting, "USE_HELPER_THREAD", False)
    future = posting.post(lambda: [threading.current_thread().name])
    assert future.done()
    assert future.result() == [threading.current_thread().name]
