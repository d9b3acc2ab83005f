"""Pipeline parallelism's entry points refuse bad input clearly (one-rank gloo group).

Also, in one process: the microbatch controls drive gradient accumulation exactly like
``no_sync`` (the same gradients as one big batch).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwrap
from shardwrap.assemble.root import root_of
from shardwrap.deepspeed.config import DeepSpeedConfig, PipelineConfig
from tests import models
from tests.dist import parity


@pytest.mark.parametrize(
    "method", ["set_requires_gradient_sync", "set_reshard_after_backward", "set_is_last_backward"]
)
def test_controls_take_bools(one_rank, method):
    module = shardwrap.ShardedModule(models.MLP())
    with pytest.raises(TypeError, match="expected a bool"):
        getattr(module, method)(1)


@pytest.mark.parametrize("method", ["set_requires_gradient_sync", "set_reshard_after_backward"])
def test_recurse_false_is_refused(one_rank, method):
    module = shardwrap.ShardedModule(models.MLP())
    with pytest.raises(ValueError, match="recurse=False"):
        getattr(module, method)(False, recurse=False)


def test_controls_accumulate_like_one_batch(one_rank):
    """Two micro-batches under the controls (as a pipeline stage sets them) give the
    gradients of their concatenation."""
    reference = models.MLP()
    module = shardwrap.ShardedModule(copy.deepcopy(reference))
    batches = [models.mlp_batch(seed) for seed in (1, 2)]
    for index, (x, y) in enumerate(batches):
        last = index == len(batches) - 1
        module.set_is_last_backward(last)
        module.set_requires_gradient_sync(last)
        module.set_reshard_after_backward(last)
        (F.mse_loss(module(x), y) / len(batches)).backward()
    x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
    F.mse_loss(reference(x), y).backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    # the halves' sums against the whole batch's: a reordered gradient (parity's bound for
    # the MLP; twice the largest element as its terms' scale, as tolerances.GRAD_SCALE)
    largest = max(float(p.grad.abs().max()) for p in reference.parameters())
    tol = {"rtol": 0.0, "atol": parity.reordered_relative(8) * 2.0 * largest}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name].reshape(param.shape), param.grad, msg=name, **tol)
    assert module.requires_gradient_sync


def test_pipeline_stage_needs_a_sharded_module(one_rank):
    with pytest.raises(TypeError, match="submodule: expected a ShardedModule"):
        shardwrap.ShardedPipelineStage(nn.Linear(2, 2), 0, 1, torch.device("cpu"))


@pytest.mark.parametrize("backward_type", ["input", "weight"])
def test_pipeline_stage_refuses_split_backward(one_rank, backward_type):
    module = shardwrap.ShardedModule(models.MLP())
    stage = shardwrap.ShardedPipelineStage(module, 0, 1, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="zero-bubble"):
        stage.backward_maybe_with_nosync(backward_type, {}, last_backward=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_stages": 2}, "num_stages: 2 must divide the world size 1"),
        ({"num_stages": None}, "num_stages: expected a positive int"),
        ({"num_stages": 1, "partition_method": "type:Linear"}, "partition_method"),
        ({"num_stages": 1, "topology": object()}, "topology"),
        ({"num_stages": 1, "activation_checkpoint_interval": 1}, "activation_checkpoint"),
        ({"num_stages": 1, "dynamic_shape": True}, "unsupported arguments"),
    ],
)
def test_pipeline_module_refuses(one_rank, kwargs, match):
    with pytest.raises(ValueError, match=match):
        shardwrap.pipe.PipelineModule(layers=[nn.Linear(2, 2)], **kwargs)


def test_pipeline_module_names_layers_by_index(one_rank):
    layers = [nn.Linear(2, 3), torch.tanh, shardwrap.pipe.LayerSpec(nn.Linear, 3, 1)]
    model = shardwrap.pipe.PipelineModule(layers=layers, num_stages=1, loss_fn=F.mse_loss)
    assert [n for n, _ in model.named_parameters()] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    ]
    assert model(torch.ones(4, 2)).shape == (4, 1)


def test_config_pipeline_block():
    base = {"train_batch_size": 4}
    assert DeepSpeedConfig.load({**base, "pipeline": {"stages": 2}}).pipeline == PipelineConfig(
        stages=2
    )
    assert DeepSpeedConfig.load(base).pipeline is None
    with pytest.raises(ValueError, match="pipeline.partition: not supported"):
        DeepSpeedConfig.load({**base, "pipeline": {"partition": "uniform"}})
    with pytest.raises(ValueError, match="pipeline.stages: must be >= 1"):
        DeepSpeedConfig.load({**base, "pipeline": {"stages": 0}})


def _config(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        **extra,
    }


def test_initialize_pipeline_errors(one_rank):
    with pytest.raises(ValueError, match="pipeline: give the model as a shardwrap.pipe"):
        shardwrap.initialize(model=nn.Linear(2, 2), config=_config(pipeline={"stages": 1}))
    model = shardwrap.pipe.PipelineModule(layers=[nn.Linear(2, 2)], num_stages=1)
    with pytest.raises(ValueError, match="loss_fn"):
        shardwrap.initialize(model=model, config=_config())
    model.loss_fn = F.mse_loss
    with pytest.raises(
        ValueError, match="pipeline.stages: 2, but the PipelineModule has num_stages=1"
    ):
        shardwrap.initialize(model=model, config=_config(pipeline={"stages": 2}))
    engine, *_ = shardwrap.initialize(model=model, config=_config(pipeline={"stages": 1}))
    with pytest.raises(RuntimeError, match="train_batch"):
        engine(torch.ones(1, 2))
    loss = engine.train_batch(iter([(torch.ones(1, 2), torch.zeros(1, 2))]))
    assert loss.dim() == 0 and engine.global_steps == 1


def test_initialize_pipeline_acts_on_or_refuses_the_zero_keys(one_rank):
    # the pipeline door builds its own ShardedModule: the keys must not be lost on the way
    model = shardwrap.pipe.PipelineModule(
        layers=[nn.Linear(2, 2)], num_stages=1, loss_fn=F.mse_loss
    )
    quantized = {"stage": 3, "zero_quantized_gradients": True}
    with pytest.raises(ValueError, match="ZeRO\\+\\+ .* not supported with a PipelineModule"):
        shardwrap.initialize(model=model, config=_config(zero_optimization=quantized))
    buckets = {"stage": 3, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 10}
    engine, *_ = shardwrap.initialize(model=model, config=_config(zero_optimization=buckets))
    schedule = root_of(engine.module).runtime.schedule
    assert (schedule.reduce_bucket_bytes, schedule.all_gather_bucket_bytes) == (4000, 40)
