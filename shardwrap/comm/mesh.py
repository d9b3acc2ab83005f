"""The FSDP2 door's device mesh: the default 1-D mesh, and what a given mesh must be."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import collectives


def data_parallel_mesh(mesh: object, device_type: str) -> DeviceMesh:
    """``mesh`` checked to be a 1-D ``DeviceMesh`` (FSDP) or a 2-D one, (replicate, shard)
    (HSDP); ``None``: a 1-D one over the default group (FSDP2's default), of ``device_type``."""
    if mesh is None:
        if not collectives.is_initialized():
            raise ValueError("mesh: None needs an initialised default process group")
        return init_device_mesh(device_type, (collectives.world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh: expected a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh: {mesh} is {mesh.ndim}-D; shardwrap.fully_shard takes a 1-D mesh (FSDP) "
            "or a 2-D (replicate, shard) mesh (HSDP), as torch's FSDP2 does: pass "
            "mesh['dp'] or mesh['dp_replicate', 'dp_shard'] of a bigger one"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError(
            f"mesh: the 2-D mesh {mesh} (HSDP) has no mesh_dim_names; name its dimensions, "
            "e.g. init_device_mesh(..., mesh_dim_names=('dp_replicate', 'dp_shard')), as "
            "torch's FSDP2 requires"
        )
    return mesh
