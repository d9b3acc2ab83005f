"""Damaged checkpoints and checkpoints of other models fail loudly, naming the culprit."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct

import torch

from shardwrap import CheckpointError, load_checkpoint, save_checkpoint
from shardwrap.ckpt import safetensors_writer
from tests import models
from tests.dist import parity
from tests.dist.ckpt_workers import bad_load_outcomes, phase, wrap
from tests.dist.harness import run_ranks


def _rank_file(folder: str, rank: int) -> str:
    (name,) = [n for n in os.listdir(folder) if n.endswith(f"rank{rank:05d}.safetensors")]
    return os.path.join(folder, name)


def _data_start(path: str, key: str) -> int:
    """Byte offset of ``key``'s data in a safetensors file."""
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    return 8 + header_len + header[key]["data_offsets"][0]


def _copy(source: str, folder: str) -> str:
    shutil.copytree(source, folder)
    return folder


def test_damaged_and_mismatched_checkpoints(tmp_path):
    good = str(tmp_path / "good")
    run_ranks(phase, 2, "FULL_SHARD", None, good, None, 0)

    flipped = _copy(good, str(tmp_path / "flipped"))
    target = _rank_file(flipped, 1)
    offset = _data_start(target, "param/blocks.0.fc.weight") + 5
    with open(target, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x10]))

    truncated = _copy(good, str(tmp_path / "truncated"))
    target = _rank_file(truncated, 0)
    os.truncate(target, os.path.getsize(target) // 2)

    traversal = _copy(good, str(tmp_path / "traversal"))
    index_path = os.path.join(traversal, "index.json")
    index = json.load(open(index_path))
    old = os.path.basename(_rank_file(traversal, 0))
    index["files"]["../escape.safetensors"] = index["files"].pop(old)
    for entry in index["params"].values():
        for piece in entry["pieces"]:
            if piece["file"] == old:
                piece["file"] = "../escape.safetensors"
    json.dump(index, open(index_path, "w"))

    missing = _copy(good, str(tmp_path / "missing"))
    os.remove(_rank_file(missing, 1))

    cases = [
        (good, {}, True),
        (flipped, {}, True),
        (truncated, {}, True),
        (traversal, {}, True),
        (missing, {}, True),
        (good, {"mlp": True}, True),
        (good, {"depth": 3}, True),
        (good, {"depth": 3}, False),
        (good, {"vocab": 80}, True),
    ]
    outcomes = run_ranks(bad_load_outcomes, 1, cases)[0]
    ok, flip, trunc, trav, miss, other, deeper, deeper_lax, wider = outcomes
    assert ok == "ok"
    assert "checksum mismatch" in flip and "rank00001" in flip, flip
    assert "'param/blocks.0.fc.weight'" in flip, flip  # among the tensors of the bad chunk
    assert "truncated" in trunc and "rank00000" in trunc, trunc
    assert "path traversal" in trav and "../escape.safetensors" in trav, trav
    assert "missing" in miss and "rank00001" in miss, miss
    assert "another model" in other, other
    assert "missing ['blocks.2.ln1.weight'" in deeper and "unexpected []" in deeper, deeper
    assert deeper_lax == "ok"
    assert "'tok.weight'" in wider and "(64, 32)" in wider and "(80, 32)" in wider, wider


def _full_disk_on_rank1(rank: int, world_size: int, folder: str) -> tuple[str, list[str]]:
    """Save once, then again with rank 1's disk full: the error, and the files left."""
    torch.manual_seed(0)
    model = wrap(models.MLP(depth=1), world_size, "FULL_SHARD")
    optim = parity.make_optimizer(model, "adamw")
    save_checkpoint(folder, model, optim)
    real = safetensors_writer._raw_bytes

    def fill_the_disk(item):
        if rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(item)

    safetensors_writer._raw_bytes = fill_the_disk
    try:
        save_checkpoint(folder, model, optim)
        error = "saved"
    except CheckpointError as exc:
        error = str(exc)
    finally:
        safetensors_writer._raw_bytes = real
    load_checkpoint(folder, model, optim)  # the previous save is intact
    return error, sorted(os.listdir(folder))


def test_a_failed_save_removes_every_ranks_new_file(tmp_path):
    folder = str(tmp_path / "ckpt")
    (error, left), _ = run_ranks(_full_disk_on_rank1, 2, folder)
    assert "rank 1: OSError" in error and "No space left on device" in error, error
    assert "rank00001.safetensors" in error and folder in error, error
    index = json.load(open(os.path.join(folder, "index.json")))
    runs = [f"{index['save_id']}-rank{r:05d}.run.json" for r in range(index["world_size"])]
    # rank 0's new files (pieces and run state) are gone; the committed save's are kept
    assert left == sorted(["index.json", *index["files"], *runs]), left
