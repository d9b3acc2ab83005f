"""Checkpoint API edges on one rank (in-process group), and the consolidation helpers."""

from __future__ import annotations

import pytest
import torch

from shardwrap import (
    CheckpointError,
    MixedPrecision,
    ShardedModule,
    load_checkpoint,
    save_checkpoint,
)
from shardwrap.ckpt.consolidate import parse_dtype, parse_size, plan_shards
from tests import models
from tests.dist import parity
from tests.dist.refusal_cases import changes, run_snapshot


def _trained_mlp_with_sgd():
    torch.manual_seed(0)
    model = ShardedModule(models.MLP())
    optim = parity.make_optimizer(model, "sgd")  # momentum buffers: per-parameter tensors
    for step in range(2):
        models.mlp_loss(model, models.mlp_batch(step)).backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def test_sgd_momentum_and_hyperparameters_round_trip(one_rank, tmp_path):
    model, optim = _trained_mlp_with_sgd()
    optim.param_groups[0]["lr"] = 0.123  # a scheduler moved it
    save_checkpoint(tmp_path / "c", model, optim, extra=[1, "two", {"three": 3.0}])
    torch.manual_seed(1)
    fresh = ShardedModule(models.MLP())
    fresh_optim = parity.make_optimizer(fresh, "sgd")
    assert load_checkpoint(tmp_path / "c", fresh, fresh_optim) == [1, "two", {"three": 3.0}]
    assert fresh_optim.param_groups[0]["lr"] == 0.123
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        want = optim.state[p]["momentum_buffer"]
        torch.testing.assert_close(fresh_optim.state[q]["momentum_buffer"], want, rtol=0, atol=0)
    # Both continue alike, bit for bit.
    for m, o in ((model, optim), (fresh, fresh_optim)):
        models.mlp_loss(m, models.mlp_batch(9)).backward()
        o.step()
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_bad_arguments_are_named(one_rank, tmp_path):
    model, optim = _trained_mlp_with_sgd()
    with pytest.raises(CheckpointError, match="extra: must be JSON"):
        save_checkpoint(tmp_path / "c", model, extra={"f": object()})
    foreign = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(CheckpointError, match=r"param_groups\[0\] holds a tensor of shape \(3,\)"):
        save_checkpoint(tmp_path / "c", model, foreign)
    save_checkpoint(tmp_path / "c", model)
    before = run_snapshot(model, optim, None)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(tmp_path / "c", model, optim)
    assert changes(before, run_snapshot(model, optim, None)) == []
    with pytest.raises(TypeError, match="expected a ShardedModule"):
        save_checkpoint(tmp_path / "c", models.MLP())


def test_size_dtype_and_shard_planning():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size(123) == 123
    for bad in ("", "5XB", "-1", 0, "0GB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
    assert parse_dtype("BF16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype: unknown 'int4'"):
        parse_dtype("int4")
    sizes = [("a", 4), ("b", 4), ("c", 10), ("d", 1)]
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "d"]]


def test_parameters_outside_units_and_dtype_mismatch(one_rank, tmp_path):
    torch.manual_seed(0)
    net = models.MLP()
    model = ShardedModule(net, ignored_modules=[net.head])  # head stays a plain parameter
    save_checkpoint(tmp_path / "c", model)
    torch.manual_seed(1)
    other_net = models.MLP()
    other = ShardedModule(other_net, ignored_modules=[other_net.head])
    load_checkpoint(tmp_path / "c", other)
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
    wide = ShardedModule(models.MLP().double())
    before = run_snapshot(wide, None, None)
    with pytest.raises(CheckpointError, match="'body.0.weight': checkpoint dtype torch.float32"):
        load_checkpoint(tmp_path / "c", wide)
    assert changes(before, run_snapshot(wide, None, None)) == []


def test_mixed_precision_saves_the_fp32_master_weights(one_rank, tmp_path):
    torch.manual_seed(0)
    low = ShardedModule(models.MLP(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    optim = parity.make_optimizer(low, "adamw")
    models.mlp_loss(low, models.mlp_batch(0)).backward()
    optim.step()
    full = low.state_dict()
    assert {v.dtype for v in full.values()} == {torch.float32}
    save_checkpoint(tmp_path / "c", low, optim)
    torch.manual_seed(1)
    plain = ShardedModule(models.MLP())
    plain_optim = parity.make_optimizer(plain, "adamw")
    load_checkpoint(tmp_path / "c", plain, plain_optim)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)
    for p, q in zip(optim.param_groups[0]["params"], plain_optim.param_groups[0]["params"]):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            want = optim.state[p][name]  # loaded: the saved tensors themselves
            torch.testing.assert_close(plain_optim.state[q][name], want, rtol=0, atol=0)
