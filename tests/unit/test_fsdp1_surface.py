"""Every public name of torch's FSDP1 surface is on shardwrap, or in one table with a reason.

Walked: ``torch.distributed.fsdp.__all__`` (against ``shardwrap``), the members of its
enums, ``torch.distributed.fsdp.wrap.__all__`` (against ``shardwrap.wrap``) and the public
attributes ``FullyShardedDataParallel`` defines (against ``shardwrap.FullyShardedDataParallel``;
the nn.Module methods it overrides must be overridden too). ``NOT_PROVIDED`` is the table;
``docs/migrating-from-fsdp.md`` shows the same names to users.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn

import shardwrap
import shardwrap.wrap
from shardwrap.base.records import as_record
from shardwrap.base.warn_once import forget_warned
from tests import models

_FSDP2 = "FSDP2, not part of the FSDP1 promise"
_LOCAL = "LOCAL_STATE_DICT is refused with an error naming SHARDED_STATE_DICT"

# The one table of torch's FSDP1-surface names shardwrap does not provide, with the reason.
NOT_PROVIDED = {
    "MixedPrecisionPolicy": _FSDP2,
    "OffloadPolicy": _FSDP2,
    "CPUOffloadPolicy": _FSDP2,
    "UnshardHandle": _FSDP2,
    "share_comm_ctx": _FSDP2,
    "DataParallelMeshDims": _FSDP2,
    "GradientReductionHandle": _FSDP2 + " (new in torch 2.15)",
    "LocalStateDictConfig": _LOCAL,
    "LocalOptimStateDictConfig": _LOCAL,
    "StateDictType.LOCAL_STATE_DICT": _LOCAL,
}

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-fsdp.md"


def _torch_fsdp_methods() -> list[str]:
    names = set()
    for base in torch_fsdp.FullyShardedDataParallel.__mro__:
        if base in (nn.Module, object):
            continue
        names.update(n for n in vars(base) if not n.startswith("_"))
    return sorted(names)


def _enum_members() -> list[tuple[str, type[enum.Enum], enum.Enum]]:
    found = []
    for name in torch_fsdp.__all__:
        value = getattr(torch_fsdp, name)
        if isinstance(value, type) and issubclass(value, enum.Enum):
            found.extend((f"{name}.{m.name}", value, m) for m in value)
    return found


def test_every_module_level_name_is_provided_or_listed():
    problems = []
    for module, ours in ((torch_fsdp, shardwrap), (torch_wrap, shardwrap.wrap)):
        for name in module.__all__:
            present = hasattr(ours, name)
            if present == (name in NOT_PROVIDED):
                problems.append(
                    f"{module.__name__}.{name}: present={present}, listed={not present}"
                )
    assert problems == []


def test_every_enum_member_is_accepted_or_listed():
    problems = []
    for label, torch_enum, member in _enum_members():
        ours = getattr(shardwrap, torch_enum.__name__)
        try:
            accepted = ours.parse(member) is not None
        except ValueError:
            accepted = False
        if accepted == (label in NOT_PROVIDED):
            problems.append(f"{label}: accepted={accepted}")
    assert problems == []


def test_every_option_record_converts_from_torch():
    for name in torch_fsdp.__all__:
        cls = getattr(torch_fsdp, name)
        ours = getattr(shardwrap, name, None)
        if not dataclasses.is_dataclass(cls) or ours is None or name == "StateDictSettings":
            continue
        if not dataclasses.is_dataclass(ours):  # StateDictConfig: a marker base class
            assert isinstance(shardwrap.FullStateDictConfig(), ours), name
            continue
        converted = as_record(name, cls(), ours)
        assert type(converted) is ours, name


def test_every_fsdp_method_is_provided_or_listed(one_rank):
    instance = shardwrap.FullyShardedDataParallel(models.TinyGPT())
    ours = shardwrap.FullyShardedDataParallel
    problems = []
    for name in _torch_fsdp_methods():
        if hasattr(nn.Module, name):  # torch overrides it: so must we
            present = any(name in vars(c) for c in ours.__mro__ if c not in (nn.Module, object))
        else:
            present = hasattr(ours, name) or name in vars(instance) or name in instance._modules
        if present == (name in NOT_PROVIDED):
            problems.append(f"FullyShardedDataParallel.{name}: present={present}")
    assert problems == []


def test_the_table_is_the_documented_one():
    text = DOC.read_text()
    block = text.split("<!-- fsdp1-not-provided -->")[1].split("<!-- /fsdp1-not-provided -->")[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.+) \|$", block, flags=re.MULTILINE)
    assert {name for name, _ in rows} == set(NOT_PROVIDED)


# ------------------------------------------------------- behaviour of the additions
def test_torch_option_objects_are_accepted(one_rank):
    forget_warned()  # an earlier test in this process may have warned already
    with pytest.warns(UserWarning, match=r"use_orig_params=False\): not acted on"):
        model = shardwrap.FullyShardedDataParallel(
            models.TinyGPT(),
            cpu_offload=torch_fsdp.CPUOffload(offload_params=False),
            mixed_precision=torch_fsdp.MixedPrecision(
                param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32
            ),
            sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
            backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_POST,
            device_id=torch.device("cpu"),
            sync_module_states=True,
            use_orig_params=False,
        )
    assert model.cpu_offload == shardwrap.CPUOffload(offload_params=False)
    with pytest.raises(ValueError, match="_use_dtensor"):
        as_record(
            "x",
            torch_fsdp.ShardedStateDictConfig(_use_dtensor=True),
            shardwrap.ShardedStateDictConfig,
        )
    with pytest.raises(TypeError, match="cpu_offload: expected CPUOffload or DiskOffload, got int"):
        shardwrap.FullyShardedDataParallel(models.TinyGPT(), cpu_offload=3)
    with pytest.raises(ValueError, match="SHARDED_STATE_DICT"):
        model.set_state_dict_type(
            model, torch_fsdp.StateDictType.LOCAL_STATE_DICT, torch_fsdp.LocalStateDictConfig()
        )
    with pytest.raises(TypeError, match="FULL_STATE_DICT takes FullOptimStateDictConfig"):
        model.set_state_dict_type(
            model, "FULL_STATE_DICT", None, torch_fsdp.ShardedOptimStateDictConfig()
        )
    settings = model.set_state_dict_type(
        model,
        torch_fsdp.StateDictType.SHARDED_STATE_DICT,
        torch_fsdp.ShardedStateDictConfig(offload_to_cpu=True),
        torch_fsdp.ShardedOptimStateDictConfig(offload_to_cpu=False),
    )
    assert settings == shardwrap.StateDictSettings(
        shardwrap.StateDictType.FULL_STATE_DICT,
        shardwrap.FullStateDictConfig(),
        shardwrap.FullOptimStateDictConfig(),
    )
    now = model.get_state_dict_type(model)
    assert now.optim_state_dict_config == shardwrap.ShardedOptimStateDictConfig(
        offload_to_cpu=False
    )
    assert isinstance(now.state_dict_config, shardwrap.StateDictConfig)


def test_fsdp1_instance_methods(one_rank):
    from torch.distributed.algorithms._comm_hooks import default_hooks

    model = shardwrap.FullyShardedDataParallel(models.TinyGPT())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm = model.clip_grad_norm_(1.0)  # no backward yet: no gradients
    assert norm.item() == 0.0 and norm.dtype == torch.float32
    assert any("with no gradients" in str(w.message) for w in caught)
    model.register_comm_hook(None, default_hooks.reduce_scatter_hook)  # what we do anyway
    with pytest.raises(NotImplementedError, match=r"reduce_dtype=torch.bfloat16"):
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    with pytest.raises(NotImplementedError, match="custom communication hooks"):
        model.register_comm_hook(None, lambda state, grad: None)

    def zero_linear(module):
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)

    assert model.apply(zero_linear) is model
    assert model.state_dict()["blocks.0.fc.weight"].abs().sum() == 0
    assert model.check_is_root() and shardwrap.FullyShardedDataParallel.fsdp_modules(model) == [
        model
    ]
    assert isinstance(model.module, models.TinyGPT)
