"""``fully_shard(..., dp_mesh_dims=...)``'s checks ([Note: dp_mesh_dims on the door]), on
one rank: each refusal names the argument and what is wrong. What the door trains with
it, against torch's FSDP2, is tests/dist/test_torchtitan_fsdp2.py (torchtitan's default
backend) and tests/dist/test_fsdp2_dp_mesh_dims.py (annotated parameters, FSDP and
HSDP). On torch 2.13 every call with plain parameters is refused, as torch's is.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.tensor import DTensor, Replicate

import shardwrap
from shardwrap.base.torch_compat import fsdp2_translates_spmd_types

RELEASE_REFUSAL = "dp_mesh_dims: torch before 2.14"


def _mesh(shape=(1,), names=("dp_shard",)):
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _refused(match: str, module: nn.Module, **kwargs) -> None:
    """Refused naming ``match`` where this torch translates spmd_types, else as torch 2.13
    refuses every call with plain parameters."""
    expected = match if fsdp2_translates_spmd_types() else RELEASE_REFUSAL
    with pytest.raises(ValueError, match=expected):
        shardwrap.fully_shard(module, **kwargs)


def test_dp_mesh_dims_of_another_type_is_refused(one_rank):
    with pytest.raises(TypeError, match="dp_mesh_dims: expected None or a torch"):
        shardwrap.fully_shard(nn.Linear(2, 2), mesh=_mesh(), dp_mesh_dims=("dp_shard",))


def test_the_mesh_must_name_the_axes(one_rank):
    dims = DataParallelMeshDims(shard="dp_shard")
    with pytest.raises(ValueError, match="dp_mesh_dims: needs mesh= a DeviceMesh with"):
        shardwrap.fully_shard(nn.Linear(2, 2), dp_mesh_dims=dims)
    with pytest.raises(ValueError, match="mesh axis 'fsdp' is not in the mesh's"):
        dims = DataParallelMeshDims(shard="fsdp")
        shardwrap.fully_shard(nn.Linear(2, 2), mesh=_mesh(), dp_mesh_dims=dims)


@pytest.mark.parametrize(
    ("shape", "names", "dims", "match"),
    [
        ((1, 1), ("dp_shard", "tp"), {"shard": "dp_shard"}, r"mesh axes \['tp'\] that are not"),
        ((1,), ("dp_replicate",), {"replicate": "dp_replicate"}, "with replicate only"),
        ((1, 1), ("dp_shard", "cp"), {"shard": ("dp_shard", "cp")}, "with several axes"),
        (
            (1, 1),
            ("dp_shard", "dp_replicate"),
            {"shard": "dp_shard", "replicate": "dp_replicate"},
            r"HSDP needs the mesh ordered \(replicate, shard\)",
        ),
    ],
)
def test_meshes_beyond_data_parallel_axes_are_refused_by_name(one_rank, shape, names, dims, match):
    mesh = _mesh(shape, names)
    _refused(match, nn.Linear(2, 2), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims))


def test_parameters_fsdp2_would_refuse_are_refused(one_rank):
    """Unannotated plain parameters (FSDP2 then wants DTensors) and DTensor parameters
    (``full_dtensor``, not supported) are refused before anything is sharded."""
    dims = DataParallelMeshDims(shard="dp_shard")
    plain = nn.Linear(2, 2)
    _refused("without spmd_types annotations", plain, mesh=_mesh(), dp_mesh_dims=dims)
    assert type(plain) is nn.Linear and not isinstance(plain.weight, DTensor)  # untouched
    mesh = _mesh()
    distributed = nn.Linear(2, 2)
    for name, param in list(distributed.named_parameters()):
        value = DTensor.from_local(param.detach(), mesh, [Replicate()])
        setattr(distributed, name, nn.Parameter(value))
    _refused("with DTensor parameters", distributed, mesh=mesh, dp_mesh_dims=dims)


def test_type_checking_is_refused(one_rank):
    if not fsdp2_translates_spmd_types():
        _refused("", nn.Linear(2, 2), mesh=_mesh(), dp_mesh_dims=DataParallelMeshDims("dp_shard"))
        return
    import spmd_types as spmd
    from spmd_types.checker import typecheck

    with typecheck():
        assert spmd.is_type_checking()
        _refused(
            "under spmd_types type checking",
            nn.Linear(2, 2),
            mesh=_mesh(),
            dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"),
        )


def test_torch_refuses_unannotated_plain_parameters_on_every_release(one_rank):
    """What the door's refusal of unannotated plain parameters follows: torch's own
    fully_shard refuses them with ``dp_mesh_dims`` too (its DTensor path), on every release."""
    from torch.distributed.fsdp import fully_shard

    with pytest.raises(ValueError, match="all parameters must be DTensors"):
        fully_shard(
            nn.Linear(2, 2), mesh=_mesh(), dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")
        )
    assert torch.distributed.is_initialized()
