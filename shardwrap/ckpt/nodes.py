"""Which ranks share a node, and which rank of another node holds a rank's copies.

Nodes are consecutive blocks of ``ranks_per_node`` world ranks (torchrun's numbering).
Rank ``r``'s *peer* is the rank at the same place on the next node, ``(r + ranks_per_node)
mod world_size``: it keeps a copy of ``r``'s memory-tier files ([Note: checkpoint tiers]).
Losing one node then loses no file, since its ranks' copies live on the next node and the
copies it held are of the previous node, whose own files survive.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from ..comm.collectives import Communicator
from ..comm.json_values import all_gather_json


@dataclass(frozen=True, slots=True)
class NodeMap:
    """World ranks grouped into nodes of ``ranks_per_node`` consecutive ranks."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node: {self.ranks_per_node} does not divide the world size "
                f"{self.world_size}"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def peer_of(self, rank: int) -> int:
        """The rank (on the next node) that keeps copies of ``rank``'s files."""
        return (rank + self.ranks_per_node) % self.world_size

    def source_of(self, rank: int) -> int:
        """The rank (on the previous node) whose copies ``rank`` keeps."""
        return (rank - self.ranks_per_node) % self.world_size


def node_map(comm: Communicator, ranks_per_node: int | None) -> NodeMap:
    """The world's nodes: ``ranks_per_node`` given, or found from the ranks' host names
    (one small all-gather; the same answer on every rank)."""
    if ranks_per_node is not None:
        return NodeMap(comm.size, ranks_per_node)
    return nodes_of_hosts(all_gather_json(comm, socket.gethostname(), purpose="checkpoint"))


def nodes_of_hosts(hosts: list[str]) -> NodeMap:
    """The nodes of ranks whose host names (by world rank) are ``hosts``: they must form
    equal blocks of consecutive ranks, one block per host."""
    blocks = [hosts[0]]
    for host in hosts[1:]:
        if host != blocks[-1]:
            blocks.append(host)
    counts = {host: hosts.count(host) for host in blocks}
    if len(counts) != len(blocks) or len(set(counts.values())) != 1:
        raise ValueError(
            "ranks_per_node: the ranks' host names do not form equal blocks of consecutive "
            f"ranks ({hosts}); pass ranks_per_node explicitly"
        )
    return NodeMap(len(hosts), len(hosts) // len(blocks))
