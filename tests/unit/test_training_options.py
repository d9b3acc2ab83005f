"""Single-process checks of the training options: validation, resolution, scaler arithmetic."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

import shardwrap
from shardwrap.assemble.casts import excluded_modules
from shardwrap.core.precision import HandlePrecision, handle_precision
from shardwrap.features.grad_clip import _check_norm_type


def test_mixed_precision_options_are_validated():
    with pytest.raises(ValueError, match="param_dtype"):
        shardwrap.MixedPrecision(param_dtype=torch.int8)
    with pytest.warns(UserWarning, match="keep_low_precision_grads"):  # accepted, documented
        assert shardwrap.MixedPrecision(keep_low_precision_grads=True).keep_low_precision_grads
    with pytest.raises(TypeError, match="cast_forward_inputs"):
        shardwrap.MixedPrecision(cast_forward_inputs=1)
    with pytest.raises(TypeError, match="module_classes_to_ignore"):
        shardwrap.MixedPrecision(module_classes_to_ignore=("BatchNorm",))
    with pytest.raises(TypeError, match="mixed_precision"):
        shardwrap.MixedPrecision.parse("bf16")


def test_torch_mixed_precision_is_converted():
    ours = shardwrap.MixedPrecision.parse(
        TorchMixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float16)
    )
    assert ours == shardwrap.MixedPrecision(
        param_dtype=torch.bfloat16,
        buffer_dtype=torch.float16,
        module_classes_to_ignore=(nn.modules.batchnorm._BatchNorm,),
    )


def test_handle_precision_resolution():
    bf16 = shardwrap.MixedPrecision(param_dtype=torch.bfloat16)
    assert handle_precision(None, torch.float32) is None
    assert handle_precision(shardwrap.MixedPrecision(), torch.float32) is None
    # reduce_dtype defaults to param_dtype, as in torch
    assert handle_precision(bf16, torch.float32) == HandlePrecision(torch.bfloat16, torch.bfloat16)
    reduce_only = shardwrap.MixedPrecision(reduce_dtype=torch.bfloat16)
    assert handle_precision(reduce_only, torch.float32) == HandlePrecision(
        torch.float32, torch.bfloat16
    )
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.LayerNorm(2))
    assert excluded_modules(model, bf16) == [model[1]]


def test_norm_type_validation():
    assert _check_norm_type(2) == 2.0
    assert _check_norm_type(math.inf) == math.inf
    for bad in (0, -1.0, "fro", True):
        with pytest.raises((TypeError, ValueError), match="norm_type"):
            _check_norm_type(bad)


def test_scaler_arguments_are_validated():
    with pytest.raises(ValueError, match="backoff_factor"):
        shardwrap.ShardedGradScaler(backoff_factor=2.0)
    with pytest.raises(TypeError, match="growth_interval"):
        shardwrap.ShardedGradScaler(growth_interval=2.5)
    with pytest.raises(ValueError, match="init_scale"):
        shardwrap.ShardedGradScaler(init_scale=0.0)


def test_scaler_follows_torch_grad_scaler(one_rank):
    """Same scale sequence and same (skipped or taken) steps as torch.amp.GradScaler."""
    kwargs = {"init_scale": 4.0, "growth_interval": 2}
    ours, theirs = shardwrap.ShardedGradScaler(**kwargs), torch.amp.GradScaler("cpu", **kwargs)
    params = [nn.Parameter(torch.ones(3)) for _ in range(2)]
    optims = [torch.optim.SGD([p], lr=0.5) for p in params]
    for grad in (1.0, float("inf"), 2.0, 3.0, float("nan"), 1.0, 1.0):
        for param, optim, scaler in zip(params, optims, (ours, theirs), strict=True):
            scaler.scale(param.sum() * grad).backward()
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
        assert ours.get_scale() == theirs.get_scale()
        torch.testing.assert_close(params[0], params[1], rtol=0.0, atol=0.0)
