"""The FSDP2 door's explicit prefetch: ``set_modules_to_forward_prefetch`` and
``set_modules_to_backward_prefetch``.

torch's FSDP2 example sets them (the root prefetches block 0 in forward, each block the
next in forward and the previous in backward): the script of tests/dist/fsdp2_cases.py
with those calls equals torch's FSDP2 bit for bit at 2 and 3 ranks. Prefetch changes when a
gather is issued, never its values, so the numbers alone cannot show it is acted on:
hooks inside each block look at the other block's gather. While block 0 computes its
forward, block 1's gather is issued only when block 0 asked for it (shardwrap, like
FSDP2 on CPU, prefetches nothing in forward by itself); while block 1 computes its
backward, block 0's is issued by default (the next unit in backward order) and not when
block 1's list is empty (an explicit list replaces the default, as in FSDP2).

Negative control (run once): both methods made no-ops: the explicit case saw block 1
not issued in forward and block 0 issued in backward, failing both checks.
"""

from __future__ import annotations

import pytest

from tests.dist import fsdp2_prefetch_cases as pc
from tests.dist.harness import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_examples_prefetch_settings_equal_torch_fsdp2_bit_for_bit(world_size):
    """At 3 ranks the sums follow gloo's order ([Note: gloo's sum order]); negative
    control (run once): the door's sums in rank order, 166 differences per rank."""
    for rank, found in enumerate(run_ranks(pc.compare, world_size)):
        assert found == [], f"rank {rank}: {found[:8]}"


def test_default_prefetches_backward_only():
    for seen in run_ranks(pc.probe, 2, False):
        assert seen == {"forward": [False, False], "backward": [True, True]}, seen


def test_explicit_lists_replace_the_default_in_each_pass():
    for seen in run_ranks(pc.probe, 2, True):
        assert seen == {"forward": [True, True], "backward": [False, False]}, seen


def test_modules_fully_shard_was_not_called_on_are_refused():
    for found in run_ranks(pc.refusals, 2):
        assert len(found) == 2, found
        assert "fully_shard was called on" in found[0] and "Linear" in found[0], found
        assert "expected a list" in found[1], found
