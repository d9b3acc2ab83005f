"""DiskOffload on one rank: parity, clean-up, and clear errors for bad paths and optimizers."""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch

import shardwrap
from shardwrap.offload import is_file_backed
from tests import models
from tests.dist import disk_cases


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_disk_matches_memory_and_cleans_up(one_rank, tmp_path, strategy):
    assert disk_cases.disk_matches_memory(0, 1, str(tmp_path), strategy) == []
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_missing_file_and_read_only_paths(one_rank, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        shardwrap.ShardedModule(
            models.MLP(), cpu_offload=shardwrap.DiskOffload(str(tmp_path / "x"))
        )
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        shardwrap.ShardedModule(models.MLP(), cpu_offload=shardwrap.DiskOffload(str(not_a_dir)))
    with pytest.raises(ValueError, match="cannot write to '/proc'"):  # read-only even for root
        shardwrap.ShardedModule(models.MLP(), cpu_offload=shardwrap.DiskOffload("/proc"))
    if os.geteuid() == 0:
        return  # root writes through permission bits
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot write to"):
        shardwrap.ShardedModule(models.MLP(), cpu_offload=shardwrap.DiskOffload(str(read_only)))


def test_other_optimizers_are_refused(one_rank, tmp_path):
    model = shardwrap.ShardedModule(models.MLP(), cpu_offload=shardwrap.DiskOffload(str(tmp_path)))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    models.mlp_loss(model, models.mlp_batch(0)).backward()
    with pytest.raises(ValueError, match="Adam and AdamW only, got SGD"):
        optim.step()


def test_path_type_is_checked():
    with pytest.raises(TypeError, match="DiskOffload: path"):
        shardwrap.DiskOffload(None)


def test_state_loaded_into_memory_goes_back_to_disk(one_rank, tmp_path):
    torch.manual_seed(0)
    model = shardwrap.ShardedModule(models.MLP(), cpu_offload=shardwrap.DiskOffload(str(tmp_path)))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for seed in range(2):
        models.mlp_loss(model, models.mlp_batch(seed)).backward()
        optim.step()
        optim.zero_grad()
    saved = copy.deepcopy(optim.state_dict())
    optim.load_state_dict(saved)  # torch puts the loaded state in ordinary memory
    assert not all(is_file_backed(s["exp_avg"]) for s in optim.state.values())
    models.mlp_loss(model, models.mlp_batch(5)).backward()
    optim.step()
    assert all(is_file_backed(s["exp_avg"]) for s in optim.state.values())
    assert all(int(s["step"]) == 3 for s in optim.state.values())


def test_load_state_dict_parity(one_rank, tmp_path):
    """Disk and memory runs that both reload their optimizer state stay identical."""
    results = []
    for offload in (None, shardwrap.DiskOffload(str(tmp_path))):
        torch.manual_seed(0)
        model = shardwrap.ShardedModule(models.MLP(), cpu_offload=offload)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        for seed in range(4):
            models.mlp_loss(model, models.mlp_batch(seed)).backward()
            optim.step()
            optim.zero_grad()
            if seed == 1:
                optim.load_state_dict(copy.deepcopy(optim.state_dict()))
        results.append([p.detach().clone() for p in model.parameters()])
    for kept, mapped in zip(*results, strict=True):
        torch.testing.assert_close(mapped, kept, rtol=0, atol=0)
