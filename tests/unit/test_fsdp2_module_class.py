"""What the ``FSDP<Name>`` class swap leaves alone: containers' new modules, and copies.

Found by torch's own FSDP2 tests run with shardwrap installed (benchmarks/torch_suite):
slicing a sharded ``nn.Sequential`` gave an ``FSDPSequential`` that no ``fully_shard``
call had made (an FSDPModule with no unit), a sharded ``nn.ModuleList`` was accepted
although it has no forward to gather its unit around, and ``copy.deepcopy`` failed deep in
pickling a process group. No process group is needed: these are class and argument checks.
"""

from __future__ import annotations

import copy

import pytest
from torch import nn

from shardwrap.fsdp2.fully_shard import _check_module
from shardwrap.fsdp2.module import FSDPModule, as_fsdp_module


def _swapped_sequential() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    as_fsdp_module(model)
    return model


def test_a_slice_of_a_sharded_sequential_is_a_plain_sequential():
    model = _swapped_sequential()
    assert isinstance(model, FSDPModule) and type(model).__name__ == "FSDPSequential"
    sliced = model[:2]
    assert type(sliced) is nn.Sequential
    assert not isinstance(sliced, FSDPModule)
    assert list(sliced) == [model[0], model[1]]


def test_building_the_swapped_class_directly_builds_the_original():
    cls = type(_swapped_sequential())
    built = cls(nn.Linear(2, 3))
    assert type(built) is nn.Sequential and built[0].out_features == 3


def test_deepcopy_of_a_sharded_module_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="deepcopy of a sharded FSDPSequential"):
        copy.deepcopy(_swapped_sequential())
    # Control: before the swap the same model copies.
    plain = nn.Sequential(nn.Linear(2, 2))
    assert type(copy.deepcopy(plain)) is nn.Sequential


@pytest.mark.parametrize("container", [nn.ModuleList, nn.ModuleDict])
def test_containers_without_forward_are_refused(container):
    members = [nn.Linear(2, 2)]
    module = container(members) if container is nn.ModuleList else container({"a": members[0]})
    with pytest.raises(ValueError, match=f"nn.{container.__name__} has no forward"):
        _check_module(module)
    _check_module(nn.Sequential(*members))  # control: a container with a forward passes
