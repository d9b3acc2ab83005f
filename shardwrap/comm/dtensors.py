"""The collectives that ``DTensor`` runs for shardwrap over tensor-parallel mesh dimensions.

A tensor-parallel parameter's gradient may arrive with other placements than the
parameter's (a ``Replicate`` weight applied to a sequence-sharded input gets a ``Partial``
gradient); a full state dict needs the global tensor of each tensor-parallel block. Both
are ``DTensor`` redistributions, torch's own collectives over the mesh. They run here so
that they are recorded on the ledger like every other collective shardwrap issues.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from .collectives import CommLedger, CommRecord, Communicator


def _record(ledger: CommLedger, kind: str, purpose: str, tensor: DTensor) -> None:
    mesh = tensor.device_mesh
    size = mesh.size()
    if size > 1:
        num_bytes = tensor.numel() * tensor.element_size()
        ledger.record(CommRecord(kind, purpose, num_bytes, size))


def local_with_placements(
    tensor: DTensor, placements: Sequence[Placement], ledger: CommLedger, *, purpose: str
) -> torch.Tensor:
    """``tensor``'s local part once it has ``placements`` (redistributed if it differs)."""
    if tuple(tensor.placements) != tuple(placements):
        kind = "all_reduce" if any(p.is_partial() for p in tensor.placements) else "redistribute"
        _record(ledger, kind, purpose, tensor)
        tensor = tensor.redistribute(tensor.device_mesh, placements)
    return tensor.to_local()


def global_tensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    ledger: CommLedger,
    *,
    purpose: str,
) -> torch.Tensor:
    """The whole global tensor whose block on this rank is ``local`` (every rank of
    ``mesh`` calls it in the same order)."""
    if all(isinstance(p, Replicate) for p in placements):
        return local
    distributed = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )
    _record(ledger, "all_gather", purpose, distributed)
    return distributed.full_tensor()


def mesh_dim_comms(mesh: DeviceMesh, dims: Sequence[int], ledger: CommLedger) -> list:
    """A :class:`Communicator` over each of ``mesh``'s dimensions ``dims``."""
    return [Communicator(mesh.get_group(dim), ledger) for dim in dims]
