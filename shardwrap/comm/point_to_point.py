"""Point-to-point transfers between two ranks of a group (checkpoint files between nodes).

Unlike a collective, only the two ranks of a transfer call :func:`send_recv`, so the
collective checker does not see it; callers order their transfers the same on every rank
([Note: file bundles] in ckpt/peer_copy.py). Recorded in the communicator's ledger as a
``send`` of the sent bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import Communicator
from .ledger import CommRecord

PEER_TAG = 1 << 20  # below the pairwise collectives' tags (comm/pairwise.py), above a user's 0


def send_recv(
    comm: Communicator,
    send: torch.Tensor | None,
    recv: torch.Tensor | None,
    *,
    dst_rank: int | None,
    src_rank: int | None,
    purpose: str,
) -> None:
    """Send ``send`` (a host tensor) to group rank ``dst_rank`` and receive ``recv`` from
    ``src_rank``, both posted before either is waited for; blocks until both are done.

    A ring of ranks each sending to the next may call it all at once (every receive is
    posted with its send). Either side may be ``None`` (with its rank).
    """
    if (send is None) != (dst_rank is None) or (recv is None) != (src_rank is None):
        raise ValueError("send_recv: a tensor and its peer rank go together")
    if comm.group is None:
        raise ValueError("send_recv: a group of one rank has no peer")
    # A backend without host transport (plain nccl) moves copies on the accelerator
    # ([Note: host tensors on accelerator-only backends] in collectives.py).
    staged_recv = comm._stage(recv) if recv is not None else None
    works = []
    if staged_recv is not None:
        works.append(dist.irecv(staged_recv, group=comm.group, group_src=src_rank, tag=PEER_TAG))
    if send is not None:
        num_bytes = send.numel() * send.element_size()
        comm.ledger.record(CommRecord("send", purpose, num_bytes, comm.size))
        staged = comm._stage(send)
        works.append(dist.isend(staged, group=comm.group, group_dst=dst_rank, tag=PEER_TAG))
    for work in works:
        work.wait()
    if staged_recv is not None and staged_recv is not recv:
        recv.copy_(staged_recv)
