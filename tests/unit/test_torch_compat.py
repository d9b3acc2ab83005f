"""The torch internals shardwrap relies on, checked on the torch this venv holds.

`make test TORCH=...` runs this file on each tested release (2.13.0, 2.14.1, 2.15.0): when
a release moves one of these, the failure names it here rather than deep in a training step.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from shardwrap.base import torch_compat

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "shardwrap")
# Branching on the torch release belongs in base/torch_compat.py alone.
VERSION_BRANCH = re.compile(r"torch\.__version__|torch\.version\b|TorchVersion")


def test_preserve_version_counter_hides_in_place_writes_from_autograd():
    tensor = torch.zeros(4)
    before = tensor._version
    with torch_compat.preserve_version_counter(tensor):
        tensor.add_(1.0)
    assert tensor._version == before
    assert torch.equal(tensor, torch.ones(4))
    tensor.add_(1.0)  # the control: outside the context the write counts
    assert tensor._version == before + 1


def test_queue_backward_callback_runs_once_after_every_gradient():
    weight = nn.Parameter(torch.ones(3))
    seen: list[torch.Tensor | None] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        torch_compat.queue_backward_callback(lambda: seen.append(weight.grad))
        return grad

    weight.register_hook(hook)
    (weight * 2.0).sum().backward()
    assert len(seen) == 1
    # Queued from inside backward, run after it: the leaf's gradient is already accumulated.
    assert seen[0] is not None and torch.equal(seen[0], torch.full((3,), 2.0))


def test_storage_use_count_counts_tensors_sharing_a_storage():
    base = torch.zeros(8)
    storage = base.untyped_storage()
    alone = torch_compat.storage_use_count(storage)
    # Every tested torch has the counter; without it shardwrap stays correct but reuses
    # no gradient buffer, so a release that drops it should be noticed.
    assert alone is not None
    view = base[2:]
    assert torch_compat.storage_use_count(storage) == alone + 1
    del view
    assert torch_compat.storage_use_count(storage) == alone


def test_dtensor_of_gives_what_from_local_gives(one_rank):
    """The door's gradients (fsdp2/dtensor_views.py): a DTensor on the local tensor itself,
    with the spec's global shape, stride and placements, and no autograd record."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    local = torch.arange(12.0).view(3, 4)
    spec = torch_compat.sharded_spec(mesh, (Shard(0),), (3, 4), (4, 1), torch.float32)
    made = torch_compat.dtensor_of(local, spec)
    reference = DTensor.from_local(local, mesh, (Shard(0),), run_check=False)
    assert isinstance(made, DTensor) and made.to_local().data_ptr() == local.data_ptr()
    assert (made.shape, made.stride(), made.placements) == (
        reference.shape,
        reference.stride(),
        reference.placements,
    )
    assert made.device_mesh == mesh and made.grad_fn is None and not made.requires_grad
    assert torch.equal(made.full_tensor(), reference.full_tensor())


def test_tree_helpers_round_trip_nested_containers():
    tree = {"a": [torch.ones(1), (torch.zeros(2), 3)], "b": None}
    leaves, spec = torch_compat.tree_flatten(tree)
    rebuilt = torch_compat.tree_unflatten(leaves, spec)
    assert rebuilt["a"][1][1] == 3 and rebuilt["b"] is None
    assert torch.equal(rebuilt["a"][0], torch.ones(1))
    doubled = torch_compat.tree_map(lambda x: x * 2 if torch.is_tensor(x) else x, tree)
    assert torch.equal(doubled["a"][0], torch.full((1,), 2.0))


def test_module_and_tensor_internals_used_outside_torch_compat():
    # flat_param.py, layout/, build/ read and replace these registries in place, and
    # options.py names _BatchNorm; ckpt/state_dict.py returns _IncompatibleKeys.
    from torch.nn.modules.module import _IncompatibleKeys

    module = nn.BatchNorm1d(3)
    assert isinstance(module._parameters, dict) and set(module._parameters) == {"weight", "bias"}
    assert "running_mean" in module._buffers and isinstance(nn.Sequential(module)._modules, dict)
    replacement = nn.Parameter(torch.zeros(3))
    module._parameters["weight"] = replacement
    assert module.weight is replacement
    assert issubclass(nn.BatchNorm2d, nn.modules.batchnorm._BatchNorm)
    assert isinstance(torch.zeros(1)._version, int)
    assert _IncompatibleKeys([], [])._fields == ("missing_keys", "unexpected_keys")


def test_only_torch_compat_branches_on_the_torch_release():
    offenders = []
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("base", "torch_compat.py")):
                continue
            with open(path, encoding="utf-8") as handle:
                if VERSION_BRANCH.search(handle.read()):
                    offenders.append(os.path.relpath(path, PACKAGE))
    assert offenders == []
    # The control: the pattern finds the usual ways of asking.
    assert VERSION_BRANCH.search("if torch.__version__ >= '2.14':")
    assert VERSION_BRANCH.search("torch.version.cuda")
