"""The FSDP2 door's device mesh: the default 1-D mesh, and what a given mesh must be."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import collectives


def data_parallel_mesh(mesh: object, device_type: str) -> DeviceMesh:
    """``mesh`` checked to be a 1-D ``DeviceMesh``; ``None``: one over the default group
    (FSDP2's default), of ``device_type``."""
    if mesh is None:
        if not collectives.is_initialized():
            raise ValueError("mesh: None needs an initialised default process group")
        return init_device_mesh(device_type, (collectives.world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh: expected a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh: a {mesh.ndim}-D mesh (HSDP) is not yet supported by shardwrap.fully_shard; "
            "pass a 1-D mesh (mesh['dp'] of a bigger one)"
        )
    return mesh
