"""All-gather and reduce-scatter on gloo as direct exchanges between pairs of ranks.

Only :mod:`shardwrap.comm.collectives` calls into this module: it is the point-to-point half of
that module, kept apart for size. The Communicator records and checks each collective
before handing it here, so the ledger sees an all-gather or a reduce-scatter as before.

[Note: pairwise collectives on gloo]
torch's gloo backend all-gathers through a flat staging buffer and copies out of it, and
reduce-scatters by all-reducing a clone of the whole input: an all-reduce moves twice the
bytes of a reduce-scatter. On a machine whose cores run compute and communication alike, the CPU a
collective burns is step time. Measured on the benchmark machine (2 ranks, 5M fp32
elements, medians of 11): all-gather 7.0 ms CPU / 9-10 ms wall through torch, 4.1-4.9 /
6-7 ms pairwise; reduce-scatter 9.1-9.4 / 15-16 ms as an all-reduce, 4.9-5.0 / 7-8 ms
pairwise.

Pairwise, each rank sends every peer the slice that peer needs, straight from the
caller's tensor, and receives:

* all-gather: each peer's shard straight into its slice of the output;
* reduce-scatter: each peer's contribution to this rank's slice into one buffer per peer;
  on wait the contributions are summed in the order torch's gloo collective adds them
  ([Note: gloo's sum order] in ``comm/sum_order.py``), so the sum is torch's bit for bit
  at any number of ranks.

Each rank sends (N-1)/N of the buffer, the bytes a ring sends. Sends and receives of one
collective share a tag taken from a per-group counter; every rank issues collectives on a
group in the same order, so the counters agree, and no two collectives in flight on a
group share a tag. Tags start high so that they stay clear of a user's own
point-to-point traffic (tag 0 by default).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import posting, sum_order

_FIRST_TAG = 1 << 24
_NUM_TAGS = (1 << 31) - _FIRST_TAG
# Keyed by the group object itself: a new group starts at the first tag on every rank.
_tag_counters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _next_tag(group: dist.ProcessGroup) -> int:
    counter = _tag_counters.setdefault(group, itertools.count())
    return _FIRST_TAG + next(counter) % _NUM_TAGS


class PairwiseWork:
    """Waits for every send and receive of one collective, then runs its finishing step.

    ``posted``: the posts, issued on the helper thread ([Note: posting off the compute
    thread]); its result is their works.
    """

    def __init__(self, posted: Future, finish: Callable[[], None] | None = None) -> None:
        self._posted: Future | None = posted
        self._finish = finish

    def wait(self) -> bool:
        if self._posted is not None:
            posted, self._posted = self._posted, None
            for work in posted.result():
                work.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


def all_gather(
    group: dist.ProcessGroup, rank: int, size: int, out_full: torch.Tensor, in_shard: torch.Tensor
) -> PairwiseWork:
    """Every rank's ``in_shard`` into its slice of ``out_full`` (1D, ``size`` slices)."""
    slices = out_full.view(size, -1)
    own = slices[rank]
    if own.data_ptr() != in_shard.data_ptr():
        own.copy_(in_shard.reshape(-1))
    tag = _next_tag(group)
    exchanges = [(own, slices[peer], peer) for peer in _peers(rank, size)]
    return PairwiseWork(posting.post(functools.partial(_exchange, group, exchanges, tag)))


@dataclass(frozen=True, slots=True)
class PeerSlices:
    """What a reduce-scatter may know of its slices beyond their size.

    ``reference_gaps``: where a peer's layout pads this rank's slice ([Note: gloo's sum
    order]); ``real_numels``: each rank's real elements, at its slice's front, the rest
    padding that is not sent (its sum is zeros); None: every element is real.
    """

    reference_gaps: tuple[tuple[int, int], ...] = ()
    real_numels: tuple[int, ...] | None = None

    def real(self, rank: int, slice_numel: int) -> int:
        return slice_numel if self.real_numels is None else self.real_numels[rank]

    def sent_bytes(self, rank: int, size: int, in_full: torch.Tensor) -> int | None:
        """Bytes ``rank`` sends reduce-scattering ``in_full`` (None: a ring's share)."""
        if self.real_numels is None:
            return None
        numel = in_full.numel() // size
        others = sum(self.real(peer, numel) for peer in range(size) if peer != rank)
        return others * in_full.element_size()


def reduce_scatter(
    group: dist.ProcessGroup,
    rank: int,
    size: int,
    out_shard: torch.Tensor,
    in_full: torch.Tensor,
    peer_slices: PeerSlices = PeerSlices(),
) -> PairwiseWork:
    """The sum over ranks of ``in_full``'s slice ``rank``, into ``out_shard``, added in
    gloo's order ([Note: gloo's sum order]); only real elements travel (``peer_slices``).

    ``in_full`` is only read, and must stay unchanged until the wait.
    """
    slices = in_full.view(size, -1)
    numel = slices.shape[1]
    real = peer_slices.real(rank, numel)
    received = torch.empty((size - 1, real), dtype=in_full.dtype, device=in_full.device)
    tag = _next_tag(group)
    exchanges = [
        (slices[peer, : peer_slices.real(peer, numel)], received[index], peer)
        for index, peer in enumerate(_peers(rank, size))
    ]
    posted = posting.post(functools.partial(_exchange, group, exchanges, tag))
    contributions = [
        slices[rank, :real] if peer == rank else received[_peer_index(rank, peer, size)]
        for peer in range(size)
    ]
    gaps, itemsize = peer_slices.reference_gaps, in_full.element_size()
    runs = [r for r in sum_order.sum_runs(rank, size, numel, itemsize, gaps) if r.start < real]

    def finish() -> None:
        out = out_shard.view(-1)
        for run in runs:
            start, end = run.start, min(run.end, real)
            terms = [contributions[peer][start:end] for peer in run.order]
            torch.add(terms[0], terms[1], out=out[start:end])
            for term in terms[2:]:
                out[start:end].add_(term)
        out[real:].zero_()

    return PairwiseWork(posted, finish)


def all_gather_placed(
    group: dist.ProcessGroup,
    rank: int,
    size: int,
    out: torch.Tensor,
    in_shard: torch.Tensor,
    places: tuple[tuple[tuple[int, int, int], ...], ...],
) -> PairwiseWork:
    """Every rank's shard pieces into ``out`` where ``places`` puts them ([Note: placed
    all-gathers] in ``core/chunk_copy.py``): ``places[r]`` lists rank ``r``'s non-empty
    pieces as ``(shard_start, shard_end, out_start)``, end to end from the shard's start.

    Each rank sends every peer those pieces as one message (the padding after them is not
    sent); a peer's lands in a buffer of its own, its pieces copied to their places at the
    wait, this rank's own at once: one copy of everything, one message a peer.
    """
    _copy_pieces(out, in_shard, places[rank])
    tag = _next_tag(group)
    peers = _peers(rank, size)
    own = _extent(places[rank])
    landed = {peer: in_shard.new_empty(_extent(places[peer])) for peer in peers}
    sends = [(in_shard[:own], peer) for peer in peers if own]
    receives = [(landed[peer], peer) for peer in peers if landed[peer].numel()]

    def finish() -> None:
        for peer in peers:
            _copy_pieces(out, landed[peer], places[peer])

    posted = posting.post(functools.partial(_post, group, sends, receives, tag))
    return PairwiseWork(posted, finish)


def _extent(pieces: tuple[tuple[int, int, int], ...]) -> int:
    """Shard elements the pieces span (they lie end to end from 0)."""
    return pieces[-1][1] if pieces else 0


def _copy_pieces(out: torch.Tensor, source: torch.Tensor, pieces) -> None:
    for start, end, at in pieces:
        out[at : at + end - start].copy_(source[start:end])


def _post(group: dist.ProcessGroup, sends: list, receives: list, tag: int) -> list:
    """Send each ``(tensor, peer)`` of ``sends``, receive each of ``receives``; their works."""
    works = [group.send([tensor], peer, tag) for tensor, peer in sends]
    return works + [group.recv([tensor], peer, tag) for tensor, peer in receives]


def all_to_all(
    group: dist.ProcessGroup, rank: int, size: int, out: torch.Tensor, inp: torch.Tensor
) -> PairwiseWork:
    """Slice ``peer`` of ``inp`` to each peer; each peer's slice for this rank into slice
    ``peer`` of ``out`` (both 1D, ``size`` slices). ``inp`` must stay unchanged until the wait."""
    sends, receives = inp.view(size, -1), out.view(size, -1)
    receives[rank].copy_(sends[rank])
    tag = _next_tag(group)
    exchanges = [(sends[peer], receives[peer], peer) for peer in _peers(rank, size)]
    return PairwiseWork(posting.post(functools.partial(_exchange, group, exchanges, tag)))


def _exchange(
    group: dist.ProcessGroup, exchanges: list[tuple[torch.Tensor, torch.Tensor, int]], tag: int
) -> list:
    """Send and receive ``(outgoing, incoming, peer)`` for every peer; their works."""
    works = []
    for outgoing, incoming, peer in exchanges:
        works.append(group.send([outgoing], peer, tag))
        works.append(group.recv([incoming], peer, tag))
    return works


def _peers(rank: int, size: int) -> list[int]:
    # Starting after ``rank`` spreads the first messages over all peers.
    return [(rank + step) % size for step in range(1, size)]


def _peer_index(rank: int, peer: int, size: int) -> int:
    """Position of ``peer`` in ``_peers(rank, size)``."""
    return (peer - rank) % size - 1
