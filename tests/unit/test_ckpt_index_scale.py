"""Checkpoint metadata does not grow with the number of ranks (torch's fake process group).

One process plays rank r of N ranks (``backend="fake"``: collectives move nothing). The
benchmark's simulation of the other ranks' records is checked here against the real
records of every rank of a small job; then the index and what a rank receives are
compared at 2 and 64 ranks. See [Note: piece runs] and docs/checkpoint-format.md.
"""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import bench_ckpt_index as bench
from shardwrap.ckpt import slots as ckpt_slots

TINY = bench.SHAPES["tiny"]
# A file's index entry: its name, size, sha256, chunk size and one chunk digest (a small
# file); about 230 bytes. Everything else in the index must not grow with the ranks.
FILE_ENTRY_BYTES = 260


@pytest.mark.parametrize("world_size", [3, 8])
def test_the_simulated_records_are_the_real_ones_at_every_rank(world_size):
    layouts = bench.unit_layouts(TINY, world_size)
    for rank in range(world_size):
        with bench.fake_ranks(world_size, rank):
            model, optimizer = bench.wrapped(TINY)
            records = bench.real_records(ckpt_slots.model_slots(model), optimizer)
        assert sorted(records, key=repr) == sorted(bench.rank_records(layouts, rank), key=repr)


def _index_sections(world_size: int) -> dict[str, int]:
    result = bench.measure(TINY, world_size, format_1=False)
    return {
        "files": result["index_bytes"] - result["index_bytes_besides_files"],
        "rest": result["index_bytes_besides_files"],
        "pieces": result["pieces"],
    }


def test_the_index_grows_by_one_small_entry_per_file_only():
    small, large = _index_sections(2), _index_sections(64)
    assert large["pieces"] > 5 * small["pieces"]  # the pieces do multiply...
    assert large["rest"] <= 1.25 * small["rest"], (small, large)  # ...their listing does not
    assert large["files"] <= 64 * FILE_ENTRY_BYTES, large


def test_a_saving_rank_receives_the_same_bytes_at_2_and_64_ranks(tmp_path):
    """Rank 1 sends its report to rank 0 and receives only fixed-size all-reduces."""
    seen = {}
    for world_size in (2, 64):
        folder = str(tmp_path / f"world{world_size}")
        records = bench.save_as(1, world_size, folder)
        _own_file(folder)  # rank 1 wrote its file; rank 0 (absent) no index
        kinds = sorted((r.kind, r.num_bytes) for r in records if r.kind != "gather_object")
        assert all(r.kind != "all_gather_object" for r in records)
        assert [r.kind for r in records].count("gather_object") == 1
        seen[world_size] = kinds
    assert seen[2] == seen[64] == sorted([("all_reduce", 16), ("all_reduce", 8), ("all_reduce", 4)])


def _own_file(folder: str) -> str:
    names = sorted(os.listdir(folder))  # its tensors and its run state, no index
    assert [n.split("-", 1)[1] for n in names] == ["rank00001.run.json", "rank00001.safetensors"]
    return names[1]


def test_the_benchmark_reports_its_figures():
    result = bench.measure(TINY, 4, format_1=True)
    json.dumps(result)
    assert result["other_rank_received_bytes"] == 16 + 8 + 4
    assert result["format_1_index_bytes"] > result["index_bytes_besides_files"]
