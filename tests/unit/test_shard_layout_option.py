"""``WrapOptions.layout``: which layout a root's units use, a typed option checked at
construction and agreed across ranks.

Negative controls: a string instead of a ``ShardLayout`` member is refused (not taken as
truthy); two options differing only in the layout give different agreement strings, so
ranks that disagree are refused by ``check_plan`` before any collective; the chunk layout's
64-element alignment is asserted against the unaligned one-shard layout, which it would
equal if the builder ignored the shard count.
"""

from __future__ import annotations

import pytest

from shardwrap.assemble.wrap_options import WrapOptions
from shardwrap.layout.chunks import ChunkLayout
from shardwrap.layout.flat import FlatLayout
from shardwrap.layout.shard_layout import ALIGN_NUMEL, ShardLayout

ENTRIES = [("a", (3, 5), True), ("b", (7,), True), ("c", (2, 2), False)]


def test_flat_is_every_door_s_default():
    assert WrapOptions().layout is ShardLayout.FLAT
    assert WrapOptions().fsdp1_units is True


def test_a_layout_that_is_no_shard_layout_is_refused_by_name():
    with pytest.raises(TypeError, match="layout: expected a ShardLayout"):
        WrapOptions(layout="dim0_chunks")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fsdp1_units"):
        WrapOptions(fsdp1_units="yes")  # type: ignore[arg-type]


def test_ranks_that_differ_in_layout_do_not_agree():
    flat = WrapOptions().agreed()
    chunks = WrapOptions(layout=ShardLayout.DIM0_CHUNKS).agreed()
    assert flat != chunks
    assert "dim0_chunks" in chunks


def test_builders_make_the_layout_they_name():
    assert isinstance(ShardLayout.FLAT.builder(2)(ENTRIES, 2), FlatLayout)
    sharded = ShardLayout.DIM0_CHUNKS.builder(2)(ENTRIES, 2)
    assert isinstance(sharded, ChunkLayout)
    assert all(info.offset % ALIGN_NUMEL == 0 for info in sharded.params)
    # One shard computes on the shard itself, end to end: no alignment gaps.
    single = ShardLayout.DIM0_CHUNKS.builder(1)(ENTRIES, 1)
    assert [info.offset for info in single.params] == [0, 15, 22]
    assert [info.offset for info in sharded.params] != [0, 15, 22]
