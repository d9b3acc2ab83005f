"""Checkpoint files sent between ranks: a rank's memory-tier files to its peer, and the
files a node lacks when it loads.

[Note: file bundles]
Files travel as one ``uint8`` tensor per pair of ranks: an 8-byte little-endian length,
a JSON manifest (each file's name, size and sha256, or the sender's error), then the
files' bytes in manifest order. Its length goes first (an 8-byte transfer), so the
receiver allocates exactly what comes. The receiver hashes every file and writes it
(atomically, ``format.write_atomic``) only when the digest matches the manifest's and,
for a file the index lists, the index's: a copy is never trusted more than the original.
Nothing is pickled. A sender that cannot read a file still sends (its error, in the
manifest), so the pair never waits on each other; the receiver raises it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from ..comm.collectives import Communicator
from ..comm.point_to_point import send_recv
from .format import CheckpointError, CheckpointIndex, check_plain_name, write_atomic
from .nodes import NodeMap

LENGTH_BYTES = 8
PURPOSE = "checkpoint_peer"


@dataclass(frozen=True, slots=True)
class Transfer:
    """Files ``names`` go from world rank ``sender``'s folder to ``receiver``'s."""

    sender: int
    receiver: int
    names: tuple[str, ...]


def bundle(folder: str, names: list[str]) -> torch.Tensor:
    """The files ``names`` of ``folder`` as one bundle ([Note: file bundles]), read
    straight into it: one copy of the files in memory."""
    try:
        # A digest is 64 hex digits, so the manifest's length is known before they are.
        entries = [
            {"name": n, "size": os.path.getsize(os.path.join(folder, n)), "sha256": "0" * 64}
            for n in names
        ]
        head_bytes = len(_manifest(entries, None))
        payload = torch.empty(head_bytes + sum(e["size"] for e in entries), dtype=torch.uint8)
        view = memoryview(payload.numpy()).cast("B")
        position = head_bytes
        for entry in entries:
            chunk = view[position : position + entry["size"]]
            with open(os.path.join(folder, entry["name"]), "rb") as handle:
                if handle.readinto(chunk) != entry["size"]:
                    raise OSError(f"{entry['name']} changed size while it was read")
            entry["sha256"] = hashlib.sha256(chunk).hexdigest()
            position += entry["size"]
    except OSError as exc:
        failed = _manifest([], f"{type(exc).__name__}: {exc}")
        return torch.frombuffer(bytearray(failed), dtype=torch.uint8)
    view[:head_bytes] = _manifest(entries, None)
    return payload


def _manifest(entries: list[dict], error: str | None) -> bytes:
    text = json.dumps({"files": entries, "error": error}).encode("ascii")
    return len(text).to_bytes(LENGTH_BYTES, "little") + text


def unbundle(
    payload: torch.Tensor,
    folder: str,
    index: CheckpointIndex | None,
    expected: dict[str, str],
    src: int,
) -> list[str]:
    """Check and write the files of a bundle from rank ``src``; returns their names.

    ``expected``: digests the files must have besides the manifest's (the index's own
    are always checked for the files it lists)."""
    raw = memoryview(payload.numpy()).cast("B")
    length = int.from_bytes(raw[:LENGTH_BYTES], "little")
    manifest = json.loads(bytes(raw[LENGTH_BYTES : LENGTH_BYTES + length]).decode("ascii"))
    if manifest["error"] is not None:
        raise CheckpointError(
            f"rank {src} could not send its checkpoint files: {manifest['error']}"
        )
    position, written = LENGTH_BYTES + length, []
    os.makedirs(folder, exist_ok=True)
    for entry in manifest["files"]:
        name, size = entry["name"], int(entry["size"])
        check_plain_name(folder, name)
        data = raw[position : position + size]
        position += size
        digests = {entry["sha256"], expected.get(name, entry["sha256"])}
        if index is not None and name in index.files:
            digests.add(index.files[name].sha256)
        if digests != {hashlib.sha256(data).hexdigest()}:
            raise CheckpointError(
                f"file {name!r} from rank {src}: sha256 mismatch (the copy is corrupt); "
                f"not written to {folder}"
            )
        write_atomic(folder, name, data)
        written.append(name)
    return written


def _send(comm: Communicator, payload: torch.Tensor, dst: int) -> None:
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    send_recv(comm, size, None, dst_rank=dst, src_rank=None, purpose=PURPOSE)
    send_recv(comm, payload, None, dst_rank=dst, src_rank=None, purpose=PURPOSE)


def _receive(comm: Communicator, src: int) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.int64)
    send_recv(comm, None, size, dst_rank=None, src_rank=src, purpose=PURPOSE)
    payload = torch.empty(int(size), dtype=torch.uint8)
    send_recv(comm, None, payload, dst_rank=None, src_rank=src, purpose=PURPOSE)
    return payload


def copy_to_peer(
    comm: Communicator, nodes: NodeMap, folder: str, own: list[str], index: CheckpointIndex
) -> list[str]:
    """Send this rank's files ``own`` (in ``folder``) to its peer on the next node, and
    write the files this rank's source sends into ``folder``; every rank at once (a ring).
    Returns the names written."""
    rank = comm.rank
    outgoing = bundle(folder, own)
    dst, src = nodes.peer_of(rank), nodes.source_of(rank)
    sizes = torch.tensor([outgoing.numel()], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    send_recv(comm, sizes[0], sizes[1], dst_rank=dst, src_rank=src, purpose=PURPOSE)
    incoming = torch.empty(int(sizes[1]), dtype=torch.uint8)
    send_recv(comm, outgoing, incoming, dst_rank=dst, src_rank=src, purpose=PURPOSE)
    return unbundle(incoming, folder, index, {}, src)


def run_transfers(
    comm: Communicator,
    transfers: list[Transfer],
    folder: str,
    index: CheckpointIndex | None,
    expected: dict[str, str],
) -> list[str]:
    """Run ``transfers`` in their order (the same list on every rank; each rank takes part
    in its own only): blocking pairs in one global order cannot deadlock. Returns the names
    this rank wrote into ``folder``; raises the first failure after its part is done."""
    written, failure = [], None
    for transfer in transfers:
        if comm.rank == transfer.sender:
            _send(comm, bundle(folder, list(transfer.names)), transfer.receiver)
        elif comm.rank == transfer.receiver:
            payload = _receive(comm, transfer.sender)
            try:
                written += unbundle(payload, folder, index, expected, transfer.sender)
            except (CheckpointError, OSError) as exc:
                failure = failure or exc
    if failure is not None:
        raise failure
    return written
