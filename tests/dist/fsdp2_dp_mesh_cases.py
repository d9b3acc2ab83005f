"""``fully_shard(..., dp_mesh_dims=...)`` with spmd_types-annotated parameters, on torch's
FSDP2 and on shardwrap's door (worker side of test_fsdp2_dp_mesh_dims.py).

Each rank annotates the tiny model's plain parameters with spmd_types local types on the
named mesh's axes (``spmd.assert_type``, as torchtitan's ``spmd_types`` backend does),
then shards every block and the root with the mesh and its ``DataParallelMeshDims``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh

import shardwrap
from tests.dist import fsdp2_cases as fc

SIDES = {"torch": torch_fsdp.fully_shard, "shardwrap": shardwrap.fully_shard}
# By name: the mesh's shape and axis names, the DataParallelMeshDims, and the spmd_types
# local type every parameter is annotated with on each axis ("R", or "S0": sharded on
# dim 0); dims None: no dp_mesh_dims.
CASES = {
    "fsdp": ((2,), ("dp_shard",), {"shard": "dp_shard"}, "R"),
    "hsdp": (
        (2, 2),
        ("dp_replicate", "dp_shard"),
        {"shard": "dp_shard", "replicate": "dp_replicate"},
        "R",
    ),
    "sharded_annotation": ((2,), ("dp_shard",), {"shard": "dp_shard"}, "S0"),
    "annotated_without_dims": ((2,), ("dp_shard",), None, "R"),
}


def _annotate(model: torch.nn.Module, mesh, kind: str) -> None:
    import spmd_types as spmd

    local = spmd.R if kind == "R" else spmd.S(0)
    axes = [spmd.MeshAxis.of(mesh.get_group(name)) for name in mesh.mesh_dim_names]
    for param in model.parameters():
        spmd.assert_type(param, dict.fromkeys(axes, local))


def run(rank: int, side: str, case: str) -> fc.Record | str:
    """Train ``CASES[case]`` on ``side``'s ``fully_shard``: the record, or the error."""
    shape, names, dims, kind = CASES[case]
    torch.manual_seed(0)
    model = fc.TinyModel()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    _annotate(model, mesh, kind)
    extra = {} if dims is None else {"dp_mesh_dims": torch_fsdp.DataParallelMeshDims(**dims)}
    try:
        for block in model.blocks:
            SIDES[side](block, mesh=mesh, **extra)
        SIDES[side](model, mesh=mesh, **extra)
    except (ValueError, RuntimeError, AssertionError) as error:  # alike on every rank
        return f"{type(error).__name__}: {error}"
    return fc.train_record(model, rank)


def compare(rank: int, world_size: int, case: str) -> dict:
    """Both sides' outcome of ``case``: each side's error (or None), and the differences
    of two records."""
    dist.barrier()
    theirs = run(rank, "torch", case)
    dist.barrier()
    ours = run(rank, "shardwrap", case)
    errors = {
        side: r if isinstance(r, str) else None
        for side, r in (("torch", theirs), ("shardwrap", ours))
    }
    both = not isinstance(theirs, str) and not isinstance(ours, str)
    return {"errors": errors, "differences": fc.differences(theirs, ours) if both else None}
