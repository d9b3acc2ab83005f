"""Tensor-parallel parameters: ``DTensor``s whose local blocks shardwrap shards further.

[Note: ZeRO over tensor-parallel parameters]
A model parallelized with ``torch.distributed.tensor.parallel.parallelize_module`` holds
``DTensor`` parameters on a tensor-parallel (TP) mesh: each rank's *local* tensor is a
block of the global parameter (``layout/blocks.py``). ``ShardedModule`` over the
data-parallel (DP) group treats each such local tensor as the parameter: it is what goes
into the unit's flat buffer, what the DP ranks split, all-gather and reduce-scatter, so
ZeRO shards ``1/DP`` of each TP block and every collective it issues stays within DP.
While a unit computes, the module shows ``DTensor``s again: the full views of ``flat_full``
wrapped with the parameter's own mesh, placements, global shape and stride, so TP's
forward and backward run exactly as without shardwrap. Their gradients are ``DTensor``s;
the local gradient (redistributed to the parameter's placements first, should it come
``Partial``) is what is flattened and reduced over DP. Outside forward and backward the
module shows, and the optimizer steps, plain 1-D pieces of the local blocks, as for any
other parameter.

A :class:`TPSpec` is what shardwrap records of each such parameter at wrap time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..comm import dtensors
from ..comm.collectives import CommLedger
from ..layout.blocks import Block, sharded_block


@dataclass(frozen=True, eq=False)
class TPSpec:
    """How one tensor-parallel parameter is laid out on its mesh, and this rank's block."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    stride: tuple[int, ...]  # the global tensor's
    block: Block  # global shape, and where this rank's local tensor lies in it

    @property
    def shard_dims(self) -> tuple[int, ...]:
        """The mesh dimensions whose ranks hold different blocks."""
        return tuple(i for i, p in enumerate(self.placements) if isinstance(p, Shard))

    @property
    def is_first_replica(self) -> bool:
        """Whether this rank is coordinate 0 along every mesh dim that replicates (it saves)."""
        coordinate = self.mesh.get_coordinate()
        return all(
            coordinate[i] == 0 for i, p in enumerate(self.placements) if isinstance(p, Replicate)
        )

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (shaped like the block) as the ``DTensor`` this parameter is."""
        with torch.no_grad():
            return DTensor.from_local(
                local,
                self.mesh,
                self.placements,
                run_check=False,
                shape=torch.Size(self.block.global_shape),
                stride=self.stride,
            )

    def local_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``whole``, a tensor of the global shape."""
        block = whole
        for dim, (offset, length) in enumerate(
            zip(self.block.offsets, self.block.shape, strict=True)
        ):
            block = block.narrow(dim, offset, length)
        return block

    def local_grad(self, grad: torch.Tensor, ledger: CommLedger) -> torch.Tensor:
        """The local part of a ``DTensor`` gradient, in the parameter's placements."""
        if not isinstance(grad, DTensor):
            return grad
        return dtensors.local_with_placements(grad, self.placements, ledger, purpose="tp_grads")

    def global_of(self, local: torch.Tensor, ledger: CommLedger, purpose: str) -> torch.Tensor:
        """The whole global tensor from every rank's ``local`` block (a TP collective)."""
        return dtensors.global_tensor(
            local.reshape(self.block.shape),
            self.mesh,
            self.placements,
            self.block.global_shape,
            self.stride,
            ledger,
            purpose=purpose,
        )


def tp_spec_of(fqn: str, param: torch.Tensor) -> TPSpec | None:
    """The spec of a ``DTensor`` parameter (``None`` for a plain one)."""
    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    placements = tuple(param.placements)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"module: parameter {fqn!r} is a DTensor on a mesh this rank is not in")
    shards = []
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            dim = placement.dim % max(param.dim(), 1)
            shards.append((dim, mesh.size(mesh_dim), coordinate[mesh_dim]))
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"module: parameter {fqn!r} has placement {placement}; shardwrap takes "
                "DTensor parameters placed with Shard and Replicate only"
            )
    block = sharded_block(tuple(param.shape), shards)
    local = param.to_local()
    if tuple(local.shape) != block.shape:
        raise ValueError(
            f"module: parameter {fqn!r}: local tensor {tuple(local.shape)} is not torch.chunk's "
            f"block {block.shape} of {tuple(param.shape)} (uneven or strided sharding)"
        )
    return TPSpec(mesh, placements, tuple(param.stride()), block)


def shard_dim_comms(specs: list[TPSpec | None], ledger: CommLedger) -> list[tuple]:
    """Per parameter, communicators over the mesh dimensions whose ranks hold different
    blocks of it (empty for plain and replicated ones): what a gradient norm sums over
    beyond the data-parallel group. Parameters on the same mesh dims share them."""
    made: dict[tuple[int, tuple[int, ...]], tuple] = {}
    result = []
    for spec in specs:
        if spec is None or not spec.shard_dims:
            result.append(())
            continue
        key = (id(spec.mesh), spec.shard_dims)
        if key not in made:
            made[key] = tuple(dtensors.mesh_dim_comms(spec.mesh, spec.shard_dims, ledger))
        result.append(made[key])
    return result


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor shardwrap flattens for ``param``: its local block if it is a ``DTensor``."""
    return param.to_local() if isinstance(param, DTensor) else param


def as_parameter(view: torch.Tensor, spec: TPSpec | None, requires_grad: bool) -> nn.Parameter:
    """``view`` as a parameter: a ``DTensor`` one when ``spec`` says the original was."""
    return nn.Parameter(view if spec is None else spec.wrap(view), requires_grad=requires_grad)
