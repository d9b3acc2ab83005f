"""Pausing Python's cyclic garbage collector while building large acyclic structures.

Rank 0 of a checkpoint save unpickles every rank's report and folds millions of pieces
into the index. Each of those objects counts towards the collector's thresholds, and the
full collections it triggers walk every live object again: at 32,768 ranks that was most
of the time spent. None of these objects form cycles, so nothing is lost by waiting.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside; the collector's previous state is restored after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
