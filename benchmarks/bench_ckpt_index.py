"""Checkpoint metadata at scale: a 7B Llama-shaped model saved from thousands of ranks.

    PYTHONPATH=$PWD python benchmarks/bench_ckpt_index.py --world-sizes 4096,32768

One process plays world rank 0 of a job of N ranks through torch's fake process group
(``backend="fake"``: collectives return at once, moving nothing). It wraps the model
for real (FULL_SHARD, one unit per decoder layer, AdamW state after one step) from the
meta device, its storage left uninitialised (only the sizes matter), and takes rank 0's
records from ``save_checkpoint``'s own code. The N-1 other ranks' reports are computed
from the units' ``FlatLayout`` (the arithmetic that shards them), with file checksums of
the count and length format 2 writes; :func:`rank_records` is checked against the real
records at rank 0 here and at every rank of a small model in
``tests/unit/test_ckpt_index_scale.py``. Then it measures what ``save_checkpoint``
moves and builds:

* bytes received per rank: rank 0 receives every other rank's pickled report (the
  gather); any other rank receives the fixed-size all-reduces only;
* ``index.json`` size, the time rank 0 takes to build and write it from the reports,
  and the time a loading rank takes to read and parse it.

``--format-1`` also prints the figures format 1 had (per-piece records and checksums
all-gathered to every rank, every piece listed), for the comparison in
docs/checkpoint-format.md; that costs minutes and GBs of memory at 32,768 ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardwrap  # noqa: E402
from shardwrap.base.gc_pause import gc_paused  # noqa: E402
from shardwrap.ckpt import commit, fragments  # noqa: E402
from shardwrap.ckpt import slots as ckpt_slots  # noqa: E402
from shardwrap.ckpt.format import (  # noqa: E402
    DEFAULT_CHUNK_BYTES,
    FileEntry,
    TensorEntry,
    read_index,
    shard_file_name,
)
from shardwrap.ckpt.kinds import save_all  # noqa: E402
from shardwrap.ckpt.piece_records import (  # noqa: E402
    PieceRecord,
    RankReport,
    SaveContext,
    SentFragment,
    StateKind,
)
from shardwrap.layout.flat import FlatLayout  # noqa: E402
from shardwrap.policies import ModuleWrapPolicy  # noqa: E402

ADAM_STATES = ("exp_avg", "exp_avg_sq")
SAVE_ID = "0123456789abcdef"
HEADER_BYTES_PER_TENSOR = 110  # a safetensors header entry for one of our keys, about


@dataclass(frozen=True)
class LlamaShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int


SHAPES = {
    "7b": LlamaShape(32000, 4096, 11008, 32),  # Llama-2-7B: 6.74e9 parameters
    "tiny": LlamaShape(96, 16, 40, 2),
}


class Layer(nn.Module):
    """A Llama decoder layer's parameters (no forward: only the shapes matter here)."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        h, i = shape.hidden, shape.intermediate
        self.input_layernorm = nn.RMSNorm(h)
        self.q_proj, self.k_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(h)
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class LlamaShaped(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(Layer(shape) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.hidden)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)


@contextlib.contextmanager
def fake_ranks(world_size: int, rank: int):
    """This process as ``rank`` of ``world_size`` through torch's fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def wrapped(shape: LlamaShape):
    """The model wrapped as rank ``dist.get_rank()``, and AdamW with its state made."""
    with torch.device("meta"):
        model = LlamaShaped(shape)
    sharded = shardwrap.ShardedModule(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Layer}),
        param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False),
    )
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    for param in sharded.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    return sharded, optimizer


def unit_layouts(shape: LlamaShape, world_size: int) -> list[FlatLayout]:
    """The root's unit (everything outside the layers), then one unit per layer."""
    with torch.device("meta"):
        model = LlamaShaped(shape)
    named = [(n, tuple(p.shape), True) for n, p in model.named_parameters()]
    root = [entry for entry in named if not entry[0].startswith("layers.")]
    layouts = [FlatLayout.build(root, world_size)]
    for index in range(len(model.layers)):
        prefix = f"layers.{index}."
        layouts.append(FlatLayout.build([e for e in named if e[0].startswith(prefix)], world_size))
    return layouts


def real_records(slots, optimizer) -> list[PieceRecord]:
    """What ``save_checkpoint`` records for this rank's pieces."""
    return save_all(SaveContext(SAVE_ID, slots, optimizer, None)).records


def rank_records(layouts: list[FlatLayout], rank: int) -> list[PieceRecord]:
    """What ``save_checkpoint`` records for world rank ``rank`` (FULL_SHARD, AdamW, fp32)."""
    records = []
    kinds = [(StateKind.PARAM, None), *[(StateKind.OPTIM, s) for s in ADAM_STATES]]
    for kind, state in kinds:
        for layout in layouts:
            step = layout.shard_numel
            for info, piece in zip(layout.params, layout.pieces(rank), strict=True):
                if piece.numel:
                    origin = rank * step - info.offset
                    start, end = piece.param_start, piece.param_end
                    record = PieceRecord(kind, info.fqn, state, start, end, "float32", step, origin)
                    records.append(record)
    if rank == 0:  # AdamW's scalar ``step`` of every parameter, saved by rank 0 alone
        for layout in layouts:
            records += [
                PieceRecord(StateKind.OPTIM, i.fqn, "step", 0, 1, "float32") for i in layout.params
            ]
    return records


def simulated_report(records: list[PieceRecord], rank: int, part) -> RankReport:
    """A rank's report as ``save_checkpoint`` gathers it, with format 2's file checksums;
    ``part``: what it sends of its model's description (rank 0's, or its digest alone)."""
    size = 8 + HEADER_BYTES_PER_TENSOR * len(records)
    size += sum(4 * (r.end - r.start) for r in records)
    digests = [
        hashlib.sha256(f"{rank}/{c}".encode()).hexdigest()
        for c in range(-(-size // DEFAULT_CHUNK_BYTES))
    ]
    entry = FileEntry(size, digests[0], DEFAULT_CHUNK_BYTES, digests)
    return RankReport(None, shard_file_name(SAVE_ID, rank), entry, tuple(records), part)


def save_as(rank: int, world_size: int, folder: str, shape: LlamaShape = SHAPES["tiny"]):
    """``save_checkpoint`` run for real as ``rank`` of ``world_size``: its ledger records."""
    with fake_ranks(world_size, rank):
        model, optimizer = wrapped(shape)
        model.comm_ledger.reset()
        shardwrap.save_checkpoint(folder, model, optimizer)
        return list(model.comm_ledger.records)


def received_by_other_ranks(world_size: int) -> int:
    """Bytes rank 1 receives in a save: its all-reduces' results (a gather sends only).

    Measured on the small model: a rank other than 0 receives fixed-size all-reduces
    whatever the model, which is the point."""
    with tempfile.TemporaryDirectory() as folder:
        records = save_as(1, world_size, folder)
    kinds = {r.kind for r in records}
    assert kinds <= {"all_reduce", "gather_object"}, kinds
    return sum(r.num_bytes for r in records if r.kind == "all_reduce")


def measure(shape: LlamaShape, world_size: int, format_1: bool) -> dict:
    with fake_ranks(world_size, 0):
        model, optimizer = wrapped(shape)
        slots = ckpt_slots.model_slots(model)
        own = real_records(slots, optimizer)
        layouts = unit_layouts(shape, world_size)
        expected = sorted(rank_records(layouts, 0), key=repr)
        assert sorted(own, key=repr) == expected, "the simulation departs from the real records"
        part = fragments.to_send(slots, fragments.fragment(slots, optimizer))
        others = SentFragment(part.digest, None)  # not leading a stage
        reports = [simulated_report(own, 0, part)]
        reports += [
            simulated_report(rank_records(layouts, r), r, others) for r in range(1, world_size)
        ]
        received = [len(pickle.dumps(r.to_json())) for r in reports]
        with tempfile.TemporaryDirectory() as root:
            start = time.perf_counter()
            with gc_paused():  # as save_checkpoint builds it
                commit.commit_index(root, SAVE_ID, slots, optimizer, reports, None, {})
            build_s = time.perf_counter() - start
            index_path = os.path.join(root, "index.json")
            index_size = os.path.getsize(index_path)
            with open(index_path, encoding="utf-8") as handle:
                raw = json.load(handle)
            files_size = len(json.dumps({"files": raw.pop("files")}, separators=(",", ":")))
            start = time.perf_counter()
            index = read_index(root)
            parse_s = time.perf_counter() - start
        entries = [*index.params.values()]
        entries += [e for s in index.optim_state.values() for e in s.values()]
        pieces = sum(e.num_pieces for e in entries if isinstance(e, TensorEntry))
        result = {
            "world_size": world_size,
            "parameters": sum(math.prod(s.shape) for s in slots.slots),
            "pieces": pieces,
            "rank0_received_bytes": sum(received[1:]),
            "index_bytes": index_size,
            "index_bytes_besides_files": index_size - files_size,
            "build_s": build_s,
            "parse_s": parse_s,
        }
        if format_1:
            result.update(format_1_figures(layouts, world_size, reports))
    result["other_rank_received_bytes"] = received_by_other_ranks(world_size)
    return result


def format_1_figures(layouts: list[FlatLayout], world_size: int, reports: list[RankReport]) -> dict:
    """Format 1: dict records and per-piece checksums all-gathered, every piece listed."""
    total, listed, files = 0, {}, {}
    for rank, report in enumerate(reports):
        name = report.file
        records, digests = [], {}
        for record in report.records:  # no TP suffixes
            key, start, end = record.key, record.start, record.end
            records.append(
                {"kind": record.kind.value, "name": record.name, "state": record.state}
                | {"key": key, "start": start, "end": end, "dtype": record.dtype}
            )
            chunks = -(-(4 * (end - start)) // DEFAULT_CHUNK_BYTES)
            digests[key] = [
                hashlib.sha256(f"{rank}/{key}/{c}".encode()).hexdigest() for c in range(chunks)
            ]
            listed.setdefault(key, []).append(
                {"file": name, "key": key, "start": start, "end": end}
            )
        file_entry = {**report.file_entry.to_json(), "tensors": digests}
        file_entry.pop("chunks")
        old = {"error": None, "file": name, "file_entry": file_entry, "records": records}
        total += len(pickle.dumps(old))
        files[name] = file_entry
    index = {"params": {k: {"pieces": v} for k, v in listed.items()}, "files": files}
    start = time.perf_counter()
    text = json.dumps(index, indent=1)
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    json.loads(text)
    decode_s = time.perf_counter() - start
    return {
        "format_1_received_bytes_per_rank": total,
        "format_1_index_bytes": len(text.encode()),
        "format_1_json_encode_s": encode_s,
        "format_1_json_decode_s": decode_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="4096,32768")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--format-1", action="store_true", help="also format 1's figures")
    args = parser.parse_args()
    sizes = [int(s) for s in args.world_sizes.split(",")]
    for world_size in sizes:
        result = measure(SHAPES[args.shape], world_size, args.format_1)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
