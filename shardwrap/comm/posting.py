"""One helper thread per process that issues the pairwise sends and receives.

[Note: posting off the compute thread]
A gloo ``send`` writes its payload into the socket right away, on the calling thread,
when the peer has already posted the matching receive; and ``send`` and ``recv`` both
take the connection's lock, which gloo's own receiving thread holds while it reads a
large message. So a rank that issues a pairwise collective (:mod:`.pairwise`) after its
peer stalls its compute for the length of a copy or of someone else's read. That is the
rank everyone else is waiting for. Measured on the benchmark machine (2 ranks, 5M GPT,
SHARD_GRAD_OP): 7-9 ms per step inside ``send``/``recv`` on the training thread.

Here the training thread only queues the posts. A single helper thread issues them in
queue order, so every rank still posts its collectives in the order it issued them and
the tags agree. Its CPU work can run on a core that a waiting rank leaves idle. Measured
with the phase timer of ``benchmarks/RESULTS.md`` (5M GPT, one process pair, the two
variants alternating): step time 126.4 -> 124.7 ms (SHARD_GRAD_OP), 126.1 -> 121.9
(SHARD_OPTIM), 135.5 -> 129.8 (FULL_SHARD); DDP 118.6.

The helper needs the GIL only to start the posts. Every wait on a collective releases the
GIL, so a blocked training thread never keeps the helper from posting what a peer waits
for. After a ``fork`` the child starts its own helper when it first posts; the parent's
thread does not exist there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

# False: post on the caller's thread instead, as before the helper existed (the
# benchmark's ``*_inline_posts`` variants measure the difference).
USE_HELPER_THREAD = True

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def post(issue: Callable[[], list[Any]]) -> Future:
    """Run ``issue`` (which posts sends and receives and returns their works) on the helper.

    Calls run one at a time, in the order they were made. The future's result is the list
    ``issue`` returned; its exception, if ``issue`` raised. Without the helper
    (``USE_HELPER_THREAD = False``) ``issue`` runs, and raises, right here.
    """
    if not USE_HELPER_THREAD:
        done: Future = Future()
        done.set_result(issue())
        return done
    return _helper().submit(issue)


def _helper() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwrap-post")
        return _executor


def _forget_helper_in_child() -> None:
    global _executor, _lock
    _executor = None
    _lock = threading.Lock()  # the parent may have held it while forking


os.register_at_fork(after_in_child=_forget_helper_in_child)
