"""``dp_mesh_dims``: the data-parallel axes of a named SPMD mesh, as FSDP2 takes them.

[Note: dp_mesh_dims on the door]
``fully_shard(module, mesh=storage_mesh, dp_mesh_dims=DataParallelMeshDims(shard=...,
replicate=...))`` gives FSDP2 the model's whole storage mesh (named axes, model-parallel
ones included) and names the axes it shards and replicates over. The parameters are
either DTensors on that mesh or plain tensors carrying spmd_types local types
(torchtitan's default ``spmd_backend="spmd_types"``), which torch 2.14 and later
translate into DTensor placements; torch 2.13 takes the argument but refuses plain
parameters with it ("all parameters must be DTensors on the full SPMD mesh").

FSDP2 stores each parameter as a DTensor on the whole mesh: ``Shard(0)`` on the shard
axis, ``Replicate()`` on the replicate axis, what the parameter says on any other axis.
Where the mesh has no other axis, that is what the door builds from the mesh alone, a 1-D
mesh (FSDP) or a (replicate, shard) one (HSDP), as without ``dp_mesh_dims``; FSDP2 takes
a data-parallel axis to be replicated (``spmd.R``) before it shards, so an annotation
there can only say R. That is torchtitan's data-parallel run. Everything beyond it is
refused by name: a model-parallel axis (tensor, context, expert parallel), several shard
axes flattened into one, replication alone (``DDPMeshInfo``), DTensor parameters, and
spmd_types type checking (FSDP2 then puts the annotations back on each gathered
parameter, which the door does not). On torch 2.13 the door refuses plain parameters as
torch does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..base.torch_compat import fsdp2_translates_spmd_types
from .fully_shard_args import NOT_YET


def check_dp_mesh_dims(mesh: object, dp_mesh_dims: object, params: Iterable[nn.Parameter]):
    """Refuse ``mesh``, ``dp_mesh_dims`` and the call's ``params`` where the door would not
    shard as FSDP2 does ([Note: dp_mesh_dims on the door]); where it does, the mesh itself
    is the one to shard over, as without ``dp_mesh_dims``."""
    params = list(params)
    if dp_mesh_dims is None:
        if fsdp2_translates_spmd_types():
            _refuse_annotated_without_dims(params)
        return
    shard, replicate = _dims(dp_mesh_dims)
    names = _mesh_names(mesh, shard + replicate)
    if not fsdp2_translates_spmd_types():
        _refuse_plain_as_torch_does(params)
    _check_axes(names, shard, replicate)
    _check_params(mesh, params)


def _dims(dp_mesh_dims: object) -> tuple[tuple[str, ...], tuple[str, ...]]:
    kind = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)
    if kind is None or not isinstance(dp_mesh_dims, kind):
        raise TypeError(
            "dp_mesh_dims: expected None or a torch.distributed.fsdp.DataParallelMeshDims, "
            f"got {type(dp_mesh_dims).__name__}"
        )
    return tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)


def _mesh_names(mesh: object, named: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh's axis names, each name ``dp_mesh_dims`` gives among them (torch's checks)."""
    names = getattr(mesh, "mesh_dim_names", None)
    if mesh is None or names is None:
        raise ValueError(
            "dp_mesh_dims: needs mesh= a DeviceMesh with mesh_dim_names (the storage mesh "
            f"whose axes it names), got {mesh!r}"
        )
    for name in named:
        if name not in names:
            raise ValueError(f"dp_mesh_dims: mesh axis {name!r} is not in the mesh's {names}")
    return tuple(names)


def _check_axes(names: tuple[str, ...], shard: tuple[str, ...], replicate: tuple[str, ...]):
    others = [name for name in names if name not in shard + replicate]
    if others:
        raise ValueError(
            f"dp_mesh_dims with mesh axes {others} that are not data-parallel {NOT_YET}: "
            "the door shards over data-parallel axes only (no tensor, context or expert "
            "parallel composed through spmd_types); use spmd_backend='partial_dtensor' "
            "(the data-parallel sub-mesh as mesh=) for those"
        )
    if not shard:
        raise ValueError(
            f"dp_mesh_dims with replicate only (DDP) {NOT_YET}; use DistributedDataParallel "
            "or shardwrap.ShardedModule(sharding_strategy=NO_SHARD)"
        )
    if len(shard) > 1 or len(replicate) > 1:
        raise ValueError(
            f"dp_mesh_dims with several axes in shard or replicate ({shard}, {replicate}) "
            f"{NOT_YET} (FSDP2 flattens them into one); pass one axis name each"
        )
    if replicate and names != (replicate[0], shard[0]):
        raise ValueError(
            f"dp_mesh_dims: HSDP needs the mesh ordered (replicate, shard), got axes "
            f"{names} for replicate={replicate[0]!r}, shard={shard[0]!r}"
        )


def _check_params(mesh, params: list[nn.Parameter]) -> None:
    """Each parameter as FSDP2 takes it with ``dp_mesh_dims``: plain, annotated with
    spmd_types local types, replicated (``spmd.R``) on every axis of the mesh."""
    import spmd_types as spmd  # torch >= 2.14 imports it with FSDP2 (here: translating)
    from spmd_types._mesh_axis import flatten_axes  # as torch's FSDP2 imports it

    if spmd.is_type_checking():
        raise ValueError(
            f"dp_mesh_dims under spmd_types type checking {NOT_YET}: FSDP2 puts each "
            "parameter's spmd_types annotations back on it when gathered, the door does "
            "not; turn type checking off"
        )
    axes = tuple(spmd.MeshAxis.of(mesh.get_group(name)) for name in mesh.mesh_dim_names)
    mesh_axis = flatten_axes(axes)  # every axis of the mesh, as one
    for param in params:
        if isinstance(param, DTensor):
            raise ValueError(
                f"dp_mesh_dims with DTensor parameters (spmd_backend='full_dtensor') {NOT_YET}: "
                "the door shards plain parameters annotated with spmd_types"
            )
        _check_annotations(param, mesh_axis, mesh.mesh_dim_names)


def _check_annotations(param: nn.Parameter, mesh_axis, names: tuple[str, ...]) -> None:
    """``param``'s spmd_types annotations: present, spanning the mesh (``mesh_axis``, its
    axes ``names`` as one), R on each axis, no partition spec."""
    import spmd_types as spmd
    from spmd_types._mesh_axis import flatten_axes
    from spmd_types.runtime import get_partition_spec

    shape = tuple(param.shape)
    local_type = spmd.get_local_type(param)
    if not local_type:  # FSDP2 then takes the DTensor path, and refuses plain ones
        raise ValueError(
            f"dp_mesh_dims: a parameter of shape {shape} is a plain tensor without "
            "spmd_types annotations; with dp_mesh_dims FSDP2 takes DTensors on the mesh "
            "or annotated tensors (spmd.assert_type), so annotate it or leave out "
            "dp_mesh_dims"
        )
    annotated = flatten_axes(tuple(local_type))
    if not (annotated <= mesh_axis and mesh_axis <= annotated):  # containment, both ways
        raise ValueError(
            f"dp_mesh_dims: a parameter of shape {shape} is annotated on axes "
            f"{tuple(local_type)}, which do not span the mesh {names} (partial "
            f"annotations: FSDP2 takes them under spmd.set_current_mesh(...), which "
            f"{NOT_YET}); annotate every axis"
        )
    for axis, kind in local_type.items():
        if kind is not spmd.R or not axis <= mesh_axis:
            raise ValueError(
                f"dp_mesh_dims: a parameter of shape {shape} is annotated {kind} on axis "
                f"{axis}; FSDP2 takes parameters replicated (spmd.R) on the data-parallel "
                f"axes it shards over ({names})"
            )
    if get_partition_spec(param) is not None:
        raise ValueError(
            f"dp_mesh_dims: a parameter of shape {shape} has a spmd_types partition spec "
            f"(sharded on a model-parallel axis) {NOT_YET}"
        )


def _refuse_annotated_without_dims(params: list[nn.Parameter]) -> None:
    """torch >= 2.14's FSDP2 refuses parameters carrying spmd_types annotations without
    ``dp_mesh_dims`` (it has no storage mesh to translate them to); so does the door."""
    try:
        import spmd_types as spmd
    except ImportError:  # torch then does not look for annotations either
        return
    for param in params:
        if not isinstance(param, DTensor) and spmd.get_local_type(param):
            raise ValueError(
                f"dp_mesh_dims: a parameter of shape {tuple(param.shape)} carries spmd_types "
                "annotations, which need fully_shard() with a named storage mesh and "
                "dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...) naming its "
                "data-parallel axes, as torch's FSDP2 requires"
            )


def _refuse_plain_as_torch_does(params: list[nn.Parameter]) -> None:
    """torch 2.13's FSDP2 with ``dp_mesh_dims`` takes DTensor parameters only, which the
    door does not: every call with it fails, as a call with plain parameters fails there."""
    raise ValueError(
        "dp_mesh_dims: torch before 2.14 (this one) has fully_shard take only DTensor "
        f"parameters on the full SPMD mesh with it ({len(params)} parameter(s) here), and the "
        "door not even those; "
        "torch >= 2.14 translates spmd_types annotations, and so does the door there. "
        "Pass the data-parallel mesh as mesh= without dp_mesh_dims "
        "(torchtitan: spmd_backend='partial_dtensor')"
    )
