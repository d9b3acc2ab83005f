"""State-dict options and the one-rank state dict (bit-exact with the unwrapped model)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp

from shardwrap import ShardedModule
from shardwrap.options import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from tests import models


def test_state_dict_type_parses_names_and_rejects_others():
    assert StateDictType.parse("sharded_state_dict") is StateDictType.SHARDED_STATE_DICT
    full = torch_fsdp.StateDictType.FULL_STATE_DICT
    assert StateDictType.parse(full) is StateDictType.FULL_STATE_DICT
    with pytest.raises(ValueError, match="state_dict_type: unsupported value 'LOCAL'"):
        StateDictType.parse("LOCAL")


@pytest.mark.parametrize("field", ["offload_to_cpu", "rank0_only"])
def test_full_state_dict_config_wants_bools(field):
    with pytest.raises(TypeError, match=field):
        FullStateDictConfig(**{field: 1})


def test_one_rank_state_dicts_equal_the_unwrapped_models(one_rank):
    torch.manual_seed(0)
    plain = models.TinyGPT()
    sharded = ShardedModule(copy.deepcopy(plain))
    with pytest.raises(ValueError, match="LOCAL_STATE_DICT is not supported.*SHARDED_STATE_DICT"):
        ShardedModule.set_state_dict_type(sharded, "LOCAL_STATE_DICT")
    with pytest.raises(TypeError, match="FULL_STATE_DICT takes FullStateDictConfig"):
        ShardedModule.set_state_dict_type(
            sharded, StateDictType.FULL_STATE_DICT, ShardedStateDictConfig()
        )
    with ShardedModule.state_dict_type(
        sharded,
        torch_fsdp.StateDictType.FULL_STATE_DICT,
        torch_fsdp.FullStateDictConfig(rank0_only=True),
    ):
        settings = ShardedModule.get_state_dict_type(sharded)
        assert settings.state_dict_config == FullStateDictConfig(rank0_only=True)
    assert ShardedModule.get_state_dict_type(sharded).state_dict_config == FullStateDictConfig()
    ours = sharded.state_dict()
    assert list(ours) == list(plain.state_dict())
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)
    with pytest.raises(ValueError, match=r"state_dict\['tok.weight'\]: shape \(3, 32\)"):
        sharded.load_state_dict({**ours, "tok.weight": torch.zeros(3, 32)})
    with pytest.raises(RuntimeError, match=r"missing key\(s\) \['scale'\]"):
        sharded.load_state_dict({k: v for k, v in ours.items() if k != "scale"})
