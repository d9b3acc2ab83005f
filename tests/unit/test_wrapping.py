"""Units, names and policies as an FSDP user expects them (one-rank group)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import wrap as torch_wrap

import shardwrap
from shardwrap.policies import (
    CustomPolicy,
    ModuleWrapPolicy,
    select_units,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from shardwrap.wrap import enable_wrap, wrap
from tests import models


def unit_names(model: shardwrap.ShardedModule) -> list[str]:
    return [u.name for u in model.units]


def test_names_and_state_dict_keys_are_the_unwrapped_models(one_rank):
    plain = models.TinyGPT()
    expected_params = [n for n, _ in plain.named_parameters()]
    expected_keys = list(plain.state_dict().keys())
    model = shardwrap.ShardedModule(
        models.TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({models.Block})
    )
    assert [n for n, _ in model.named_parameters()] == expected_params
    assert sorted(model.state_dict().keys()) == sorted(expected_keys)
    assert not any("_fsdp" in n or n.startswith("module.") for n in model.state_dict())
    # tied parameters stay tied, frozen ones stay frozen
    assert model.module.head.weight is model.module.tok.weight
    assert model.module.pos.requires_grad is False


def test_torch_partial_policies_work_unchanged(one_rank):
    policy = functools.partial(
        torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls={models.Block}
    )
    model = shardwrap.ShardedModule(models.TinyGPT(), auto_wrap_policy=policy)
    assert unit_names(model) == ["", "blocks.0", "blocks.1"]
    ours = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={models.Block})
    gpt = models.TinyGPT()
    assert select_units(gpt, ours, set()) == select_units(gpt, policy, set())


def test_torch_policy_objects_are_accepted(one_rank):
    model = shardwrap.ShardedModule(
        models.TinyGPT(), auto_wrap_policy=torch_wrap.ModuleWrapPolicy({models.Block})
    )
    assert unit_names(model) == ["", "blocks.0", "blocks.1"]
    custom = CustomPolicy(lambda m: isinstance(m, nn.LayerNorm))
    model = shardwrap.ShardedModule(models.TinyGPT(), auto_wrap_policy=custom)
    assert unit_names(model) == [
        "",
        "blocks.0.ln1",
        "blocks.0.ln2",
        "blocks.1.ln1",
        "blocks.1.ln2",
        "ln_f",
    ]


def test_size_based_policy_counts_unwrapped_params():
    model = models.MLP(dim=12, hidden=30, depth=3)  # linears of 390, 930, 930 and 31 params
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=900)
    chosen = select_units(model, policy, set())
    assert [type(m).__name__ for m in chosen] == ["Linear", "Linear"]
    assert all(sum(p.numel() for p in m.parameters()) >= 900 for m in chosen)


def test_each_parameter_belongs_to_exactly_one_unit(one_rank):
    model = shardwrap.ShardedModule(
        models.TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({models.Block, nn.Linear})
    )
    fqns = [i.fqn for u in model.units if u.handle for i in u.handle.layout.params]
    assert len(fqns) == len(set(fqns)) == len(list(models.TinyGPT().parameters()))
    # the tied head/embedding weight spans two modules and falls to the root unit
    root = model.units[0]
    assert "tok.weight" in [i.fqn for i in root.handle.layout.params]


def test_ignored_modules_are_left_alone(one_rank):
    plain = models.TinyGPT()
    model = shardwrap.ShardedModule(plain, ignored_modules=[plain.extra])
    assert isinstance(plain.extra.weight, nn.Parameter) and plain.extra.weight.shape == (32, 32)
    managed = [i.fqn for u in model.units if u.handle for i in u.handle.layout.params]
    assert not any(f.startswith("extra.") for f in managed)


def test_enable_wrap_nests_units_under_the_outer_root(one_rank):
    reference = models.MLP()
    plain = models.MLP()
    plain.load_state_dict(reference.state_dict())
    with enable_wrap(wrapper_cls=shardwrap.ShardedModule):
        plain.body[0] = wrap(plain.body[0])
        model = wrap(plain)
    assert isinstance(model, shardwrap.ShardedModule)
    # the wrapper is gone; the module it wrapped is an FSDP instance itself
    nested = [m for m in model.module.modules() if isinstance(m, shardwrap.ShardedModule)]
    assert nested == [plain.body[0]] and isinstance(plain.body[0], nn.Linear)
    assert sorted(unit_names(model)) == ["", "body.0"]
    x = torch.randn(3, 12)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert wrap(plain) is plain  # outside enable_wrap, wrap is the identity
    adopted = next(u for u in model.units if u.name == "body.0")
    assert [i.fqn for i in adopted.handle.layout.params] == ["body.0.weight", "body.0.bias"]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_OPTIM"])
def test_a_dropped_model_is_freed(one_rank, strategy):
    # The registry of live units holds nothing that keeps a model alive: a model dropped
    # after training is freed (with its hooks), not kept until the process ends.
    import gc
    import weakref

    plain = models.TinyGPT()
    model = shardwrap.ShardedModule(
        plain, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({models.Block})
    )
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    optim.step()
    refs = [weakref.ref(plain), weakref.ref(model)]
    del plain, model, optim
    gc.collect()
    assert [r() for r in refs] == [None, None]
