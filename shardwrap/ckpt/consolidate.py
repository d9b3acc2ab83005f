"""Offline tools on a checkpoint folder: consolidate to Hugging Face layout, inspect.

Both run in one process without ``torch.distributed``. Consolidation streams: the output
header is computed from the index alone, then each whole tensor is assembled from its
pieces, cast, written and dropped before the next, so peak memory is about one tensor.
Every piece is first checked against its file's header ([Note: checked before read] in
reader.py), so an index that declares a tensor larger than stored is refused, naming
it, before anything is allocated or written; inspect reports the same checks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from ..base.dtypes import FLOAT_ALIASES
from ..base.sizes import read_size
from .format import (
    CheckpointError,
    CheckpointIndex,
    TensorEntry,
    dtype_from_name,
    read_index,
    write_atomic,
)
from .reader import CheckpointReader, verify_files
from .safetensors_writer import StreamItem, write_stream

HF_SINGLE_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


Progress = Callable[[int, int, str], None]  # (done, total, tensor name)


def parse_dtype(text: str) -> torch.dtype:
    key = text.strip().lower()
    if key not in FLOAT_ALIASES:
        raise ValueError(f"dtype: unknown {text!r}; allowed: {', '.join(FLOAT_ALIASES)}")
    return FLOAT_ALIASES[key]


def parse_size(text: str | int) -> int:
    """Bytes in ``"5GB"``, ``"500MiB"``, ``"1e9"`` or an int; must be positive."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        read = read_size(str(text))
        if read is None:
            raise ValueError(f"max_shard_size: cannot read {text!r} (e.g. 5GB, 500MiB, 1000000)")
        value = read
    if value <= 0:
        raise ValueError(f"max_shard_size: must be positive, got {text!r}")
    return value


def full_tensor_names(index: CheckpointIndex) -> list[tuple[str, str, TensorEntry]]:
    """``(output name, saved name, entry)`` for every state-dict name, tied names included."""
    names = [(n, n, e) for n, e in index.params.items()]
    names += [(alias, target, index.params[target]) for alias, target in index.aliases.items()]
    names += [(n, n, e) for n, e in index.buffers.items()]
    return sorted(names)


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split names into files of at most ``max_bytes`` (a larger tensor gets its own file)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def consolidate(
    checkpoint: str,
    out: str,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_BYTES,
    progress: Progress | None = None,
) -> list[str]:
    """Write the model of ``checkpoint`` in Hugging Face layout to ``out``; returns file names."""
    max_bytes = parse_size(max_shard_size)
    index = read_index(checkpoint)
    if os.path.realpath(out) == os.path.realpath(checkpoint):
        raise ValueError("out: must differ from the checkpoint folder")
    reader = CheckpointReader(checkpoint, index, keep_files_open=False)
    for _, saved, entry in full_tensor_names(index):  # before any output or allocation
        reader.check_pieces(saved, entry)
    os.makedirs(out, exist_ok=True)
    items = {
        name: _item(reader, name, saved, entry, dtype)
        for name, saved, entry in full_tensor_names(index)
    }
    shards = plan_shards([(n, item.num_bytes) for n, item in items.items()], max_bytes)
    total = len(items)
    done = 0
    files = []
    for number, names in enumerate(shards, start=1):
        file = (
            HF_SINGLE_FILE
            if len(shards) == 1
            else (f"model-{number:05d}-of-{len(shards):05d}.safetensors")
        )
        batch = []
        for name in names:
            done += 1
            batch.append(_announced(items[name], progress, done, total))
        write_stream(os.path.join(out, file), batch, {"format": "pt"})
        files.append(file)
    if len(shards) > 1:
        weight_map = {name: files[i] for i, names in enumerate(shards) for name in names}
        total_size = sum(item.num_bytes for item in items.values())
        body = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        write_atomic(out, HF_INDEX_FILE, json.dumps(body, indent=2).encode("utf-8"))
        files.append(HF_INDEX_FILE)
    return files


def _item(reader, name: str, saved: str, entry: TensorEntry, dtype) -> StreamItem:
    stored = dtype_from_name(entry.dtype, f"tensor {saved!r}")
    target = dtype if dtype is not None and stored.is_floating_point else stored

    def produce() -> torch.Tensor:
        return reader.read_full(saved, entry).to(target)

    return StreamItem(name, target, entry.shape, produce)


def _announced(item: StreamItem, progress: Progress | None, done: int, total: int) -> StreamItem:
    if progress is None:
        return item

    def produce() -> torch.Tensor:
        progress(done, total, item.key)
        return item.produce()

    return StreamItem(item.key, item.dtype, item.shape, produce)


def piece_problems(checkpoint: str, index: CheckpointIndex) -> list[str]:
    """Each tensor whose pieces do not match their files' headers (the declared dtype and
    length, the key present, the file listed and readable): one message per tensor."""
    reader = CheckpointReader(checkpoint, index, keep_files_open=False)
    named = [(saved, entry) for _, saved, entry in full_tensor_names(index)]
    for name, states in (index.optim_state or {}).items():
        named += [(f"{name}/{k}", e) for k, e in states.items() if isinstance(e, TensorEntry)]
    problems = []
    for saved, entry in named:
        try:
            reader.check_pieces(saved, entry)
        except CheckpointError as exc:
            problems.append(str(exc))
    return problems


def describe(
    checkpoint: str, *, verify: bool = True, list_tensors: bool = False
) -> tuple[str, bool]:
    """A human-readable summary of ``checkpoint``, and whether every file checked out."""
    index = read_index(checkpoint)
    meta = index.meta
    lines = [
        f"checkpoint: {checkpoint}",
        f"saved by: {meta.get('world_size')} rank(s), strategy {meta.get('strategy')}, "
        f"save id {meta.get('save_id')}",
    ]
    entries = full_tensor_names(index)
    numel = sum(e.numel for e in [*index.params.values(), *index.buffers.values()])
    lines.append(
        f"model: {len(index.params)} parameters ({len(index.aliases)} tied names), "
        f"{len(index.buffers)} buffers, {numel:,} elements"
    )
    if index.optim_state is not None:
        state_names = sorted({k for states in index.optim_state.values() for k in states})
        lines.append(
            f"optimizer: state for {len(index.optim_state)} parameters ({', '.join(state_names)}), "
            f"{len(index.param_groups or [])} param groups"
        )
    else:
        lines.append("optimizer: none")
    lines.append(f"extra: {json.dumps(index.extra)[:200]}")
    status = verify_files(checkpoint, index) if verify else {f: "not checked" for f in index.files}
    problems = piece_problems(checkpoint, index) if verify else []
    if verify:
        lines.append(f"pieces: {'; '.join(problems[:3]) if problems else 'ok'}")
    for file, entry in sorted(index.files.items()):
        lines.append(
            f"file {file}: {entry.size:,} bytes, {entry.num_chunks} checksum chunks, "
            f"checksum {status[file]}"
        )
    if list_tensors:
        for name, saved, entry in entries:
            size = entry.numel * dtype_from_name(entry.dtype, name).itemsize
            tied = f" (tied to {saved})" if saved != name else ""
            lines.append(
                f"  {name}: {entry.dtype} {list(entry.shape)} {size:,} bytes "
                f"in {entry.num_pieces} piece(s){tied}"
            )
    ok = not problems and all(s in ("ok", "not checked") for s in status.values())
    return "\n".join(lines), ok
