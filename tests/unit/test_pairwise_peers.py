"""Peer order of the pairwise gloo collectives (pure arithmetic, no process group)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shardwrap.comm.pairwise import _peer_index, _peers


@st.composite
def rank_and_size(draw) -> tuple[int, int]:
    size = draw(st.integers(2, 64))
    return draw(st.integers(0, size - 1)), size


@given(rank_and_size())
def test_peers_are_every_other_rank_once(case: tuple[int, int]) -> None:
    rank, size = case
    peers = _peers(rank, size)
    assert sorted(peers) == [r for r in range(size) if r != rank]


@given(rank_and_size())
def test_peer_index_inverts_the_peer_order(case: tuple[int, int]) -> None:
    rank, size = case
    for index, peer in enumerate(_peers(rank, size)):
        assert _peer_index(rank, peer, size) == index
