"""JSON values between ranks, as bytes in ``uint8`` tensors: nothing is pickled.

[Note: no pickle between ranks]
torch's ``*_object`` collectives pickle what they send and unpickle what they receive, and
unpickling runs whatever code the bytes name. ``load_checkpoint`` promises never to
unpickle anything, and what its ranks exchange (parameter names, error texts) is plain
data, so it travels as JSON instead: each rank encodes its value, an 8-byte all-reduce
agrees on the largest (or the only) length, and the bytes go in one tensor collective,
each rank's framed as an 8-byte little-endian length then the (ASCII-escaped) text,
zero-padded to the largest. The ledger records those tensor collectives as any other.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from .collectives import Communicator

LENGTH_BYTES = 8  # the frame's length prefix


def _encoded(value: Any) -> bytes:
    # ASCII escapes: a path that is not UTF-8 decodes to lone surrogates, which UTF-8
    # cannot encode; escaped, they come back as they were.
    return json.dumps(value, separators=(",", ":")).encode("ascii")


def _decoded(payload: bytes) -> Any:
    return json.loads(payload.decode("ascii"))


def _largest(comm: Communicator, length: int, purpose: str, op=dist.ReduceOp.MAX) -> int:
    agreed = torch.tensor([length], dtype=torch.int64)
    comm.all_reduce(agreed, purpose=purpose, op=op).wait()
    return int(agreed)


def _framed(payload: bytes, width: int) -> torch.Tensor:
    framed = torch.zeros(LENGTH_BYTES + width, dtype=torch.uint8)
    prefix = len(payload).to_bytes(LENGTH_BYTES, "little")
    framed[:LENGTH_BYTES] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
    if payload:
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        framed[LENGTH_BYTES : LENGTH_BYTES + len(payload)] = body
    return framed


def _unframed(framed: torch.Tensor) -> Any:
    raw = framed.numpy().tobytes()
    length = int.from_bytes(raw[:LENGTH_BYTES], "little")
    return _decoded(raw[LENGTH_BYTES : LENGTH_BYTES + length])


def all_gather_json(comm: Communicator, value: Any, *, purpose: str) -> list[Any]:
    """Every rank's ``value`` (any JSON value), by rank, on every rank."""
    payload = _encoded(value)
    if comm.size == 1:
        return [_decoded(payload)]
    framed = _framed(payload, _largest(comm, len(payload), purpose))
    out = torch.empty(comm.size * framed.numel(), dtype=torch.uint8)
    comm.all_gather(out, framed, purpose=purpose).wait()
    return [_unframed(row) for row in out.view(comm.size, -1)]


def gather_json(comm: Communicator, value: Any, *, purpose: str, dst_rank: int = 0) -> list | None:
    """Every rank's ``value``, by rank, on group rank ``dst_rank``; ``None`` on the others.
    A rank other than ``dst_rank`` receives 8 bytes, however many ranks there are."""
    payload = _encoded(value)
    if comm.size == 1:
        return [_decoded(payload)]
    framed = _framed(payload, _largest(comm, len(payload), purpose))
    gathered = comm.gather(framed, purpose=purpose, dst_rank=dst_rank)
    return None if gathered is None else [_unframed(row) for row in gathered]


def broadcast_json(comm: Communicator, value: Any, *, purpose: str, src_rank: int = 0) -> Any:
    """Group rank ``src_rank``'s ``value`` on every rank (``value`` is ignored elsewhere):
    its length (an 8-byte all-reduce), then its bytes."""
    payload = _encoded(value) if comm.rank == src_rank else b""
    if comm.size == 1:
        return _decoded(payload)
    length = _largest(comm, len(payload), purpose, op=dist.ReduceOp.SUM)
    data = torch.zeros(length, dtype=torch.uint8)
    if payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    comm.broadcast(data, src_rank=src_rank, purpose=purpose).wait()
    return _decoded(data.numpy().tobytes())
