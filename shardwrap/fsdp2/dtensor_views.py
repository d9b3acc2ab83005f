"""The FSDP2 door's parameters and gradients: DTensors over a unit's flat shard.

[Note: DTensor shard views]
FSDP2 shows every parameter outside forward and backward as an ``nn.Parameter`` wrapping
a ``DTensor`` with placement ``Shard(0)`` on the data-parallel mesh; its local tensor is
this rank's ``torch.chunk`` piece. Under the dim-0 chunk layout ([Note: the dim-0 chunk
layout] in ``layout/chunks.py``) that piece is a contiguous range of the unit's flat
shard, so each local tensor here is a *view* of ``flat_shard``: the optimizer's in-place
updates land in the shard the next all-gather reads, and the parameter objects never
change identity ([Note: two views of each parameter] in ``flat_param.py``). They replace
the handle's plain shard views in place, before a runtime indexes them.

On a 2-D (replicate, shard) mesh (HSDP) the placements are ``(Replicate(), Shard(0))``,
as FSDP2's: the local tensor is this rank's chunk within its shard group (the mesh's
second dimension, the unit's shard communicator), the same on every replica.

Gradients follow: each reduced piece becomes a ``DTensor`` with the same mesh, placement,
global shape and stride, so ``clip_grad_norm_``, ``get_total_norm`` and optimizers see
what they see under FSDP2.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..base.torch_compat import dtensor_of, sharded_spec
from ..flat_param import FlatParamHandle
from ..layout.chunks import ChunkLayout
from . import local_step


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    stride = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def shard_placements(mesh: DeviceMesh) -> tuple[Placement, ...]:
    """FSDP2's placements on ``mesh``: ``Shard(0)``, replicated first on a 2-D mesh."""
    return (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))


def as_dtensor(local: torch.Tensor, mesh: DeviceMesh, shape: tuple[int, ...]) -> DTensor:
    """``local`` (this rank's dim-0 chunk) as its piece of a ``shape`` tensor on ``mesh``."""
    return DTensor.from_local(
        local,
        mesh,
        shard_placements(mesh),
        run_check=False,
        shape=shape,
        stride=contiguous_stride(shape),
    )


def install_dtensor_views(handle: FlatParamHandle, mesh: DeviceMesh) -> None:
    """Make ``handle``'s shard views and their gradients DTensors ([Note: DTensor shard
    views]) and show them on the module."""
    layout = handle.layout
    if not isinstance(layout, ChunkLayout):
        raise RuntimeError(f"unit {handle.unit_name!r}: DTensor views need a ChunkLayout")
    rank = handle.shard_comm.rank
    local_shapes = [layout.local_shape(i, rank) for i in range(len(layout.params))]
    for index, info in enumerate(layout.params):
        local = handle.shard_params[index].detach().view(local_shapes[index])
        with torch.no_grad():
            dtensor = as_dtensor(local, mesh, info.shape)
        # In place: the handle's gradients hold the same list.
        handle.shard_params[index] = nn.Parameter(dtensor, requires_grad=info.requires_grad)
        local_step.register(handle.shard_params[index])
    shapes = [info.shape for info in layout.params]
    specs: dict[tuple[int, torch.dtype], object] = {}  # built once: a step wraps every grad

    def grad_view(index: int, piece: torch.Tensor) -> torch.Tensor:
        key = (index, piece.dtype)
        if key not in specs:
            shape = shapes[index]
            placements = shard_placements(mesh)
            specs[key] = sharded_spec(
                mesh, placements, shape, contiguous_stride(shape), piece.dtype
            )
        return dtensor_of(piece.view(local_shapes[index]), specs[key])

    handle.grads.shard_grad_view = grad_view
    handle.show_params(handle.shard_params)
