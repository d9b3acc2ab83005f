"""Pairwise all-gather and reduce-scatter on gloo against torch's own collectives.

See [Note: pairwise collectives on gloo] in ``shardwrap/comm/pairwise.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import time

import pytest
import torch
import torch.distributed as dist

from shardwrap.comm import posting
from shardwrap.comm.collectives import CommLedger, Communicator
from shardwrap.comm.pairwise import PeerSlices
from shardwrap.core.chunk_copy import gather_places, take_shard
from shardwrap.layout.chunks import ChunkLayout
from tests.dist.harness import MULTI_RANK_WORLD_SIZES, run_ranks

SHARD_NUMEL = 7


def _inputs(rank: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(size * SHARD_NUMEL, generator=generator).to(dtype)


def _check_group(comm: Communicator, group, dtype: torch.dtype) -> dict:
    rank, size = comm.rank, comm.size
    full = _inputs(rank, size, dtype)
    shard = full[:SHARD_NUMEL].clone() + rank
    # Two collectives in flight at once on one group, plus one on a second communicator
    # over the same group: their tags must keep them apart.
    other = Communicator(group, comm.ledger)
    gathered = torch.empty(size * SHARD_NUMEL, dtype=dtype)
    reduced = torch.empty(SHARD_NUMEL, dtype=dtype)
    reduced_again = torch.empty(SHARD_NUMEL, dtype=dtype)
    works = [
        comm.all_gather(gathered, shard, purpose="params"),
        comm.reduce_scatter(reduced, full, purpose="grads"),
        other.reduce_scatter(reduced_again, full, purpose="grads"),
    ]
    for work in reversed(works):
        work.wait()
    every_shard = torch.empty(size * SHARD_NUMEL, dtype=dtype)
    dist.all_gather_single(every_shard, shard, group=group)
    expected = torch.empty(SHARD_NUMEL, dtype=dtype)
    dist.reduce_scatter_tensor(expected, full.clone(), group=group)
    # An all-gather into the output's own slice (no copy of the shard).
    in_place = torch.empty(size * SHARD_NUMEL, dtype=dtype)
    in_place.view(size, -1)[rank].copy_(shard)
    comm.all_gather(in_place, in_place.view(size, -1)[rank], purpose="params").wait()
    return {
        "gathered": torch.equal(gathered, every_shard),
        "in_place": torch.equal(in_place, every_shard),
        "reduced": torch.equal(reduced, expected),
        "reduced_again": torch.equal(reduced_again, expected),
        "input_unchanged": torch.equal(full, _inputs(rank, size, dtype)),
    }


def _blocked_rank_still_posts(world: Communicator) -> bool:
    """Rank 0 blocks in a torch collective with its pairwise posts still queued; the
    other ranks join that collective only once rank 0's posts reached them.
    See [Note: posting off the compute thread].
    """
    shard = torch.full((SHARD_NUMEL,), float(world.rank))
    gathered = torch.empty(world.size * SHARD_NUMEL)
    if world.rank == 0:  # hold the helper so the gather's posts are still queued below
        posting.post(lambda: time.sleep(0.3) or [])
    work = world.all_gather(gathered, shard, purpose="params")
    if world.rank != 0:
        work.wait()
    flag = torch.ones(1)
    dist.all_reduce(flag)  # blocking
    work.wait()
    expected = torch.arange(world.size, dtype=torch.float32).repeat_interleave(SHARD_NUMEL)
    return torch.equal(gathered, expected) and flag.item() == world.size


def _worker(rank: int, world_size: int) -> dict:
    ledger = CommLedger()
    world = Communicator(dist.group.WORLD, ledger)
    result = {"pairwise": world._pairwise(torch.empty(1))}
    result["blocked_rank_still_posts"] = _blocked_rank_still_posts(world)
    result["world"] = _check_group(world, dist.group.WORLD, torch.float32)
    result["bf16"] = _check_group(world, dist.group.WORLD, torch.bfloat16)
    # A subgroup of the last two ranks: peers are group ranks, not global ones.
    members = [world_size - 2, world_size - 1]
    sub = dist.new_group(members)
    if rank in members:
        sub_ledger = CommLedger()
        result["sub"] = _check_group(Communicator(sub, sub_ledger), sub, torch.float32)
        result["records"] = sorted({(r.kind, r.num_bytes) for r in sub_ledger.records})
    return result


@pytest.mark.parametrize("world_size", MULTI_RANK_WORLD_SIZES)
def test_pairwise_collectives_match_torch(world_size: int) -> None:
    all_true = dict.fromkeys(["gathered", "in_place", "reduced", "reduced_again"], True)
    all_true["input_unchanged"] = True
    fp32 = SHARD_NUMEL * 2 * 4
    for rank, result in enumerate(run_ranks(_worker, world_size)):
        assert result["pairwise"] is True  # otherwise torch would be compared with itself
        assert result["blocked_rank_still_posts"] is True
        assert result["world"] == all_true
        assert result["bf16"] == all_true
        if rank >= world_size - 2:
            assert result["sub"] == all_true
            # Records carry the full buffer's bytes, as torch's collectives do.
            assert result["records"] == [("all_gather", fp32), ("reduce_scatter", fp32)]


# Slice lengths where gloo's ring blocks run past the slices (7: into the next slice by one
# element at 3 ranks; 1,000,001: several segments per rank) and where they align (64).
SUM_ORDER_NUMELS = (7, 64, 1_000_001)


def _spread(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Values over many binades, so that another order of the sum changes its bits."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    return (values * torch.exp(4 * torch.randn(numel, generator=generator))).to(dtype)


def _peer_gaps(slice_index: int) -> tuple[tuple[int, int], ...]:
    """The paddings a peer's layout puts inside slice ``slice_index`` (none in slice 0),
    the first at the slice's start, where gloo's blocks overlap the slices."""
    return ((0, slice_index), (3 + slice_index, 2)) if slice_index else ()


def _with_gaps(values: torch.Tensor, gaps: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``values`` laid out with zeros at ``gaps`` (offsets in the result)."""
    out, taken, position = [], 0, 0
    for offset, length in gaps:
        out += [values[taken : taken + offset - position], values.new_zeros(length)]
        taken += offset - position
        position = offset + length
    return torch.cat([*out, values[taken:]])


def _sum_order_worker(rank: int, world_size: int, use_gaps: bool) -> list:
    """Where the pairwise reduce-scatter differs from torch's gloo collective: plainly,
    and with a peer layout padded inside the slices against the packed one (its gaps,
    and only each slice's real elements sent: the packed padding must sum to zeros and
    never travel, what was sent equal to the ledger's bytes)."""
    world = Communicator(dist.group.WORLD, CommLedger())
    differs = []
    for numel, dtype in itertools.product(SUM_ORDER_NUMELS, (torch.float32, torch.bfloat16)):
        full = _spread(rank, world_size * numel, dtype)
        ours, theirs = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        world.reduce_scatter(ours, full, purpose="grads").wait()
        dist.reduce_scatter_tensor(theirs, full.clone())
        if not torch.equal(ours, theirs):
            differs.append(("plain", numel, str(dtype)))
        gaps = [_peer_gaps(s) for s in range(world_size)]
        real = [numel - sum(length for _, length in g) for g in gaps]
        values = [_spread(1000 * rank + s, real[s], dtype) for s in range(world_size)]
        peer = torch.cat([_with_gaps(v, g) for v, g in zip(values, gaps, strict=True)])
        packed = torch.cat([torch.cat([v, v.new_zeros(numel - v.numel())]) for v in values])
        slices = PeerSlices(gaps[rank] if use_gaps else (), tuple(real))
        ours.fill_(float("nan"))
        with _counted_sends() as sent:
            world.reduce_scatter(ours, packed, purpose="grads", peer_slices=slices).wait()
        dist.reduce_scatter_tensor(theirs, peer)
        kept = _with_gaps(torch.ones(real[rank]), gaps[rank]).bool()
        if not torch.equal(ours[: real[rank]], theirs[kept]):
            differs.append(("gaps", numel, str(dtype)))
        itemsize, others = ours.element_size(), sum(real) - real[rank]
        wire = (world.ledger.records[-1].wire_bytes, float(sum(sent)), float(others * itemsize))
        if ours[real[rank] :].count_nonzero() or len(set(wire)) != 1:
            differs.append(("trimmed", numel, str(dtype), wire))
    return differs


@contextlib.contextmanager
def _counted_sends():
    """The bytes of each tensor handed to ``ProcessGroup.send`` meanwhile (any thread)."""
    # Restored from the class's own entry: pybind's method wrapper, which binds the group
    # (the attribute read off the class is the bare builtin, which would not).
    sent, original, entry = [], dist.ProcessGroup.send, dist.ProcessGroup.__dict__["send"]

    def counting_send(group, tensors, peer, tag):
        sent.append(tensors[0].numel() * tensors[0].element_size())
        return original(group, tensors, peer, tag)

    dist.ProcessGroup.send = counting_send
    try:
        yield sent
    finally:
        dist.ProcessGroup.send = entry


@pytest.mark.parametrize("world_size", [3, 4])
def test_reduce_scatter_adds_in_gloos_order(world_size: int) -> None:
    """[Note: gloo's sum order]: equal to torch's gloo reduce-scatter bit for bit, with
    and without a peer's paddings (at 2 ranks any order is exact, so 3 and 4); with real
    elements given, the padding neither sent nor summed. Negative control (run once): the
    ledger recording a ring's share for the trimmed one fails on its bytes."""
    for rank, differs in enumerate(run_ranks(_sum_order_worker, world_size, True)):
        assert differs == [], f"rank {rank}"


def test_negative_control_peer_gaps_ignored_differ() -> None:
    """The peer's paddings not given: the elements they shift are summed in the wrong
    block's order (rank 2's first at 3 ranks)."""
    differs = [d for found in run_ranks(_sum_order_worker, 3, False) for d in found]
    assert differs and all(kind == "gaps" for kind, _, _ in differs), differs


# Parameters whose dim-0 chunks are short or empty somewhere at 2 and 3 ranks (a 4-row
# weight leaves rank 2 of 3 empty, a 1-row one every rank but 0), and a scalar.
PLACED_SHAPES = ((4, 5), (7,), (1, 3), (10, 2), ())


def _placed_worker(rank: int, world_size: int) -> dict:
    """A placed all-gather ([Note: placed all-gathers]) of a chunk layout's shards: every
    parameter's full view must be the parameter; the ledger's bytes those sent."""
    torch.manual_seed(0)  # the same parameters on every rank
    params = [torch.randn(shape) for shape in PLACED_SHAPES]
    named = [(f"p{i}", tuple(p.shape), True) for i, p in enumerate(params)]
    layout = ChunkLayout.build(named, world_size, align_numel=16)
    full = torch.zeros(layout.padded_numel)
    for info, param in zip(layout.params, params, strict=True):
        full[info.offset : info.end] = param.reshape(-1)
    shard = take_shard(layout, full, rank)
    out = torch.full((layout.padded_numel,), float("nan"))
    comm = Communicator(dist.group.WORLD, CommLedger())
    places, numel = gather_places(layout), layout.gathered_numel
    with _counted_sends() as sent:
        comm.all_gather_placed(out, shard, places, gathered_numel=numel, purpose="params").wait()
    (record,) = comm.ledger.records
    own = sum(end - start for start, end, _ in places[rank])
    return {
        "views": [
            torch.equal(out[info.offset : info.end].view(info.shape), param)
            for info, param in zip(layout.params, params, strict=True)
        ],
        "ledger": (record.kind, record.num_bytes, record.wire_bytes),
        "expected": ("all_gather", 4 * numel, float(sum(sent))),
        "sent": sum(sent) == 4 * own * (world_size - 1) < record.num_bytes,
    }


@pytest.mark.parametrize("world_size", MULTI_RANK_WORLD_SIZES)
def test_placed_all_gather_puts_every_piece_where_it_belongs(world_size: int) -> None:
    """Against the parameters themselves. Negative control (run once): every piece placed
    at its parameter's start fails the views of the parameters split over ranks."""
    for rank, found in enumerate(run_ranks(_placed_worker, world_size)):
        assert all(found["views"]), (rank, found["views"])
        assert found["ledger"] == found["expected"], rank
        assert found["sent"], rank  # its pieces, never its padding
