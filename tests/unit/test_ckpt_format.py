"""The checkpoint file format without ranks: index validation, paths, checksums, streaming."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from shardwrap.ckpt.format import (
    INDEX_NAME,
    CheckpointError,
    CheckpointIndex,
    ChunkHasher,
    FileEntry,
    PieceRef,
    TensorEntry,
    check_coverage,
    index_bytes,
    member_path,
    read_index,
    remove_stale_files,
    write_atomic,
)
from shardwrap.ckpt.reader import CheckpointReader, verify_files
from shardwrap.ckpt.safetensors_writer import StreamItem, write_stream


def _items(tensors: dict[str, torch.Tensor]) -> list[StreamItem]:
    return [StreamItem(k, v.dtype, tuple(v.shape), lambda v=v: v) for k, v in tensors.items()]


def test_stream_writer_matches_safetensors_reader(tmp_path):
    tensors = {
        "a": torch.arange(10, dtype=torch.float32),
        "b": torch.randn(3, 4).to(torch.bfloat16),
        "c": torch.tensor(7, dtype=torch.int64),
        "d": torch.zeros(0),
        "e": torch.tensor([True, False, True]),
    }
    path = str(tmp_path / "x.safetensors")
    written = write_stream(path, _items(tensors), {"k": "v"})
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for key, value in tensors.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
    assert written.size == os.path.getsize(path)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_stream_writer_refuses_a_tensor_unlike_its_announcement(tmp_path):
    item = StreamItem("a", torch.float32, (3,), lambda: torch.zeros(4))
    with pytest.raises(RuntimeError, match="'a': produced"):
        write_stream(str(tmp_path / "x.safetensors"), [item])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(0, 3))
def test_coverage_accepts_exact_tilings_only(lengths, shift):
    bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    pieces = tuple(PieceRef("f", f"k{i}", s, e) for i, (s, e) in enumerate(zip(bounds, bounds[1:])))
    check_coverage("t", TensorEntry((bounds[-1],), "float32", pieces))
    if shift and bounds[-1]:
        with pytest.raises(CheckpointError, match="'t'"):
            check_coverage("t", TensorEntry((bounds[-1] + shift,), "float32", pieces))
        overlapping = (*pieces, PieceRef("f", "x", 0, 1))
        with pytest.raises(CheckpointError, match="'t'"):
            check_coverage("t", TensorEntry((bounds[-1],), "float32", overlapping))


@pytest.mark.parametrize(
    "name", ["../x.safetensors", "/etc/passwd", "a/b.safetensors", "..", ".", "", "a\\b", "a\x00"]
)
def test_member_path_refuses_anything_but_a_plain_name(tmp_path, name):
    with pytest.raises(CheckpointError, match="traversal"):
        member_path(str(tmp_path), name)


def test_member_path_refuses_a_symlink_out_of_the_folder(tmp_path):
    (tmp_path / "ckpt").mkdir()
    os.symlink("/etc/hostname", tmp_path / "ckpt" / "link.safetensors")
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        member_path(str(tmp_path / "ckpt"), "link.safetensors")
    assert member_path(str(tmp_path / "ckpt"), "ok.safetensors").endswith("ok.safetensors")


def _one_file_checkpoint(root: str, tensor: torch.Tensor, chunk_bytes: int = 1 << 22):
    """A checkpoint of one parameter ``w`` split over two pieces in one file."""
    half = tensor.numel() // 2
    flat = tensor.reshape(-1)
    name = "0123456789abcdef-rank00000.safetensors"
    items = _items({"param/w/0": flat[:half].clone(), "param/w/1": flat[half:].clone()})
    written = write_stream(os.path.join(root, name), items, chunk_bytes=chunk_bytes)
    pieces = (
        PieceRef(name, "param/w/0", 0, half),
        PieceRef(name, "param/w/1", half, flat.numel()),
    )
    index = CheckpointIndex(
        meta={"save_id": "0123456789abcdef", "world_size": 1},
        params={"w": TensorEntry(tuple(tensor.shape), "float32", pieces)},
        aliases={},
        buffers={},
        optim_state=None,
        param_groups=None,
        files={name: FileEntry(written.size, written.sha256, chunk_bytes, written.chunk_sha256)},
        extra={"step": 3},
    )
    write_atomic(root, INDEX_NAME, index_bytes(index))
    return index


def test_reader_returns_ranges_across_pieces(tmp_path):
    tensor = torch.randn(6, 5)
    _one_file_checkpoint(str(tmp_path), tensor)
    index = read_index(str(tmp_path))
    assert index.extra == {"step": 3}
    with CheckpointReader(str(tmp_path), index) as reader:
        entry = index.params["w"]
        torch.testing.assert_close(reader.read_full("w", entry), tensor, rtol=0, atol=0)
        torch.testing.assert_close(
            reader.read_range("w", entry, 7, 23), tensor.reshape(-1)[7:23], rtol=0, atol=0
        )
        with pytest.raises(CheckpointError, match="outside its 30 elements"):
            reader.read_range("w", entry, 20, 31)
    assert set(verify_files(str(tmp_path), index).values()) == {"ok"}


def test_reader_names_file_and_tensor_of_a_flipped_byte(tmp_path):
    _one_file_checkpoint(str(tmp_path), torch.randn(6, 5), chunk_bytes=16)
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".safetensors"]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    index = read_index(str(tmp_path))
    assert verify_files(str(tmp_path), index)[path.name] == "checksum mismatch"
    with CheckpointReader(str(tmp_path), index) as reader:
        entry = index.params["w"]
        reader.read_range("w", entry, 0, 15)  # the first piece is intact
        with pytest.raises(CheckpointError, match=rf"{path.name}.*'w'.*checksum mismatch"):
            reader.read_range("w", entry, 14, 30)


def test_reader_verifies_only_the_chunks_it_reads(tmp_path):
    tensor = torch.randn(6, 5)  # pieces of 15 elements; file chunks of 16 bytes
    _one_file_checkpoint(str(tmp_path), tensor, chunk_bytes=16)
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".safetensors"]
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    second = 8 + length + header["param/w/1"]["data_offsets"][0]  # w's element 15
    flipped = second + 4 * 7 + 1  # inside w's element 22
    data[flipped] ^= 0x01
    path.write_bytes(bytes(data))
    bad = flipped // 16  # the one file chunk that no longer matches
    element_bytes = {e: second + 4 * (e - 15) for e in range(15, 30)}
    in_bad = {e for e, at in element_bytes.items() if at // 16 <= bad <= (at + 3) // 16}
    index = read_index(str(tmp_path))
    flat = tensor.reshape(-1)
    with CheckpointReader(str(tmp_path), index) as reader:
        entry = index.params["w"]
        intact = [(0, min(in_bad)), (max(in_bad) + 1, 30)]
        for lo, hi in intact:  # every chunk these touch is intact
            got = reader.read_range("w", entry, lo, hi)
            torch.testing.assert_close(got, flat[lo:hi], rtol=0, atol=0)
        expected = rf"'w'.*checksum mismatch in bytes {bad * 16}..{bad * 16 + 16} of the file"
        with pytest.raises(CheckpointError, match=expected):
            reader.read_range("w", entry, 22, 23)


def test_reader_reports_a_truncated_file(tmp_path):
    _one_file_checkpoint(str(tmp_path), torch.randn(6, 5))
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".safetensors"]
    os.truncate(path, path.stat().st_size - 8)
    index = read_index(str(tmp_path))
    with CheckpointReader(str(tmp_path), index) as reader:
        with pytest.raises(CheckpointError, match=rf"{path.name}.*'w'.*truncated"):
            reader.read_full("w", index.params["w"])


def test_read_index_tells_an_unfinished_save_from_a_missing_one(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_index(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a shardwrap checkpoint"):
        read_index(str(tmp_path / "empty"))
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "0123456789abcdef-rank00001.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="incomplete.*no index.json"):
        read_index(str(tmp_path / "partial"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw.update(version=99), "format version 99"),
        (lambda raw: raw.update(format="other"), "not a shardwrap index"),
        (lambda raw: raw["params"]["w"].update(dtype="float128"), "unknown dtype"),
        (lambda raw: raw["params"]["w"].update(shape=[6, 6]), "cover 30 of its 36"),
        (lambda raw: raw["params"]["w"]["pieces"][0].update(file="x.bin"), "absent from"),
        (lambda raw: raw["params"]["w"]["pieces"][0].update(file="../x"), "traversal"),
        (lambda raw: raw["params"]["w"].pop("pieces"), "malformed"),
        (lambda raw: raw.update(params=[]), r"index.json: 'params' must be a JSON object.*list"),
        (lambda raw: raw.update(files=[]), r"index.json: 'files' must be a JSON object.*list"),
        (
            lambda raw: raw.update(optimizer={"state": [], "param_groups": []}),
            r"index.json: 'optimizer.state' must be a JSON object, not a list",
        ),
        (
            lambda raw: raw.update(optimizer={"state": {"w": []}, "param_groups": []}),
            r"index.json: 'optimizer.state.w' must be a JSON object, not a list",
        ),
        (
            lambda raw: raw.update(optimizer={"state": {}, "param_groups": 3}),
            r"index.json: 'optimizer.param_groups' must be a JSON list, not a int",
        ),
        (
            lambda raw: raw.update(optimizer={"state": {}, "param_groups": [{"params": 1}]}),
            r"index.json: 'optimizer.param_groups\[0\]' must be an object with 'params'",
        ),
    ],
)
def test_read_index_rejects_bad_indexes(tmp_path, edit, message):
    _one_file_checkpoint(str(tmp_path), torch.randn(6, 5))
    raw = json.loads((tmp_path / INDEX_NAME).read_text())
    edit(raw)
    (tmp_path / INDEX_NAME).write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        read_index(str(tmp_path))


def test_remove_stale_files_keeps_the_committed_and_foreign_files(tmp_path):
    names = [
        "0123456789abcdef-rank00000.safetensors",
        "fedcba9876543210-rank00000.safetensors",
        ".fedcba9876543210-rank00001.safetensors.tmp",
        "notes.txt",
        INDEX_NAME,
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    removed = remove_stale_files(str(tmp_path), keep={names[0]})
    assert sorted(removed) == sorted(names[1:3])
    assert sorted(os.listdir(tmp_path)) == sorted([names[0], "notes.txt", INDEX_NAME])


def test_read_index_refuses_a_key_given_twice(tmp_path):
    """JSON keeps the last copy of a key: a second ``w`` would load another tensor's data."""
    _one_file_checkpoint(str(tmp_path), torch.randn(6, 5))
    text = (tmp_path / INDEX_NAME).read_text()
    raw = json.loads(text)
    entry = raw["params"]["w"]
    entry["pieces"] = entry["pieces"][::-1]
    doubled = text.replace('"params": {', '"params": {"w": ' + json.dumps(entry) + ", ", 1)
    assert doubled != text
    (tmp_path / INDEX_NAME).write_text(doubled)
    with pytest.raises(CheckpointError, match=rf"{tmp_path}/index.json: key 'w' is given twice"):
        read_index(str(tmp_path))


def test_a_format_1_index_still_loads(tmp_path):
    """Format 1 hashed each tensor apart and listed every piece; such folders still load."""
    tensor = torch.randn(6, 5)
    index = _one_file_checkpoint(str(tmp_path), tensor, chunk_bytes=16)
    (name,) = index.files
    stored = load_file(str(tmp_path / name))
    by_key = {}
    for key, value in stored.items():
        hasher = ChunkHasher(16)
        hasher.update(value.numpy().tobytes())
        by_key[key] = hasher.finish()
    raw = index.to_json()
    raw["version"] = 1
    raw["files"][name] = {**raw["files"][name], "tensors": by_key}
    del raw["files"][name]["chunks"]
    (tmp_path / INDEX_NAME).write_text(json.dumps(raw))
    old = read_index(str(tmp_path))
    assert isinstance(old.files[name].chunk_sha256, dict)
    with CheckpointReader(str(tmp_path), old) as reader:
        got = reader.read_full("w", old.params["w"])
    torch.testing.assert_close(got, tensor, rtol=0, atol=0)
    raw["version"] = 3
    (tmp_path / INDEX_NAME).write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError, match="format version 3, this shardwrap reads versions 1, 2"
    ):
        read_index(str(tmp_path))
