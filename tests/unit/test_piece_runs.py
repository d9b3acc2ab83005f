"""Piece runs ([Note: piece runs] in shardwrap/ckpt/entries.py): the pieces a sharded save
produces fold into one run per tensor, and a run answers exactly as the listed pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwrap.ckpt.entries import (
    CheckpointError,
    PieceRef,
    PieceRun,
    SavedPiece,
    TensorEntry,
    check_coverage,
    group_pieces,
    shard_file_name,
)
from shardwrap.ckpt.format import parse_index
from shardwrap.layout.flat import FlatLayout

SAVE_ID = "00000000deadbeef"


def _saved(layout: FlatLayout, index: int, first_rank: int) -> list[SavedPiece]:
    """What the ranks of one shard group save of parameter ``index`` (as checkpoint.py)."""
    info, step = layout.params[index], layout.shard_numel
    saved = []
    for shard in range(layout.num_shards):
        piece = layout.pieces(shard)[index]
        if piece.numel:
            rank = first_rank + shard
            origin = shard * step - info.offset
            file = shard_file_name(SAVE_ID, rank)
            key = f"param/{info.fqn}"
            saved.append(
                SavedPiece(rank, file, key, piece.param_start, piece.param_end, step, origin)
            )
    return saved


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    shards=st.integers(1, 9),
    first_rank=st.integers(0, 3),
    ranges=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), max_size=5),
)
def test_runs_answer_as_the_listed_pieces(sizes, shards, first_rank, ranges):
    layout = FlatLayout.build([(f"p{i}", (n,), True) for i, n in enumerate(sizes)], shards)
    for index, numel in enumerate(sizes):
        saved = _saved(layout, index, first_rank)
        listed, runs = group_pieces(saved, SAVE_ID)
        assert len(listed) + len(runs) <= 1  # consecutive ranks: one run, or a lone piece
        entry = TensorEntry((numel,), "float32", listed, runs)
        check_coverage(f"p{index}", entry)
        explicit = [PieceRef(p.file, p.key, p.start, p.end) for p in saved]
        assert entry.num_pieces == len(explicit)
        for lo, hi in [(0, numel), *ranges]:
            lo, hi = min(lo, hi, numel), min(max(lo, hi), numel)
            want = [p for p in explicit if min(hi, p.end) > max(lo, p.start)]
            assert entry.overlapping(lo, hi) == want


def test_irregular_pieces_stay_listed():
    file = shard_file_name(SAVE_ID, 0)
    saved = [
        SavedPiece(0, file, "k", 0, 4, 4, 0),
        SavedPiece(2, shard_file_name(SAVE_ID, 2), "k", 4, 8, 4, -4),  # rank 1 skipped
        SavedPiece(3, "other.safetensors", "k", 8, 9, 4, -8),  # not this save's file name
    ]
    listed, runs = group_pieces(saved, SAVE_ID)
    assert runs == () and [p.start for p in listed] == [0, 4, 8]


@pytest.mark.parametrize(
    "run",
    [
        {"ranks": [0, 1], "key": "k", "base": 0, "step": 0, "span": [0, 8]},  # no step
        {"ranks": [1, 0], "key": "k", "base": 0, "step": 4, "span": [0, 8]},  # reversed
        {"ranks": [0, 1], "key": "k", "base": 0, "step": 4, "span": [0, 12]},  # past rank 1
        {"ranks": [0, 1], "key": "k", "base": 0, "step": 4, "span": [4, 8]},  # rank 0 empty
        {"ranks": [0, 1], "key": "k", "base": 0, "step": 4.5, "span": [0, 8]},  # not an int
    ],
)
def test_an_inconsistent_run_is_refused(run):
    raw = {"shape": [8], "dtype": "float32", "pieces": [], "runs": [run]}
    with pytest.raises(CheckpointError, match="'w'"):
        TensorEntry.from_json("w", raw, SAVE_ID)


def test_a_run_over_a_file_absent_from_the_index_is_refused(tmp_path):
    file = {"size": 1, "sha256": "0", "chunk_bytes": 8, "chunks": ["0"]}
    run = {"ranks": [0, 2], "key": "param/w", "base": 0, "step": 4, "span": [0, 12]}
    raw = {
        "format": "shardwrap-checkpoint",
        "version": 2,
        "save_id": SAVE_ID,
        "params": {"w": {"shape": [12], "dtype": "float32", "pieces": [], "runs": [run]}},
        "files": {shard_file_name(SAVE_ID, r): file for r in (0, 2)},  # rank 1's is missing
    }
    with pytest.raises(CheckpointError, match="rank00001.*absent from the index"):
        parse_index(str(tmp_path), raw)
    assert PieceRun(0, 2, "param/w", 0, 4, 0, 12, SAVE_ID).overlapping(3, 5)[1].start == 4
