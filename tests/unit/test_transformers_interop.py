"""Interchange with ``transformers``: consolidated checkpoints load with ``from_pretrained``,
and ``save_pretrained`` output loads into a sharded model."""

from __future__ import annotations

import copy

import torch
import transformers

from shardwrap import ShardedModule
from shardwrap.checkpoint import save_checkpoint
from shardwrap.ckpt.consolidate import consolidate
from shardwrap.ckpt.pretrained import load_pretrained
from shardwrap.policies import ModuleWrapPolicy


def _tiny_gpt2():
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=100,
        n_positions=32,
        n_inner=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _wrap(model):
    block = transformers.models.gpt2.modeling_gpt2.GPT2Block
    return ShardedModule(model, auto_wrap_policy=ModuleWrapPolicy({block}))


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def test_consolidated_checkpoint_loads_into_transformers(one_rank, tmp_path):
    model = _tiny_gpt2()
    reference = copy.deepcopy(model)
    save_checkpoint(tmp_path / "ckpt", _wrap(model))
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    reference.config.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    _assert_same(loaded.state_dict(), reference.state_dict())


def test_save_pretrained_output_loads_into_a_sharded_model(one_rank, tmp_path):
    reference = _tiny_gpt2()
    reference.save_pretrained(tmp_path / "hf")
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(reference.config)
    sharded = _wrap(fresh)
    load_pretrained(sharded, tmp_path / "hf")
    _assert_same(sharded.state_dict(), reference.state_dict())
