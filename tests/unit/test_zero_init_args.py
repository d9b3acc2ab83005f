"""``deepspeed.zero.Init`` on shardwrap: DeepSpeed 0.19.8's signature, and it says what it
does instead of partitioning at construction (once per process, and once per argument)."""

from __future__ import annotations

import inspect
import warnings

import deepspeed as real_deepspeed
import pytest
from torch import nn

import shardwrap as deepspeed
from shardwrap.base.warn_once import forget_warned

# DeepSpeed 0.19.8's zero.Init parameters (deepspeed/runtime/zero/partition_parameters.py).
DEEPSPEED_INIT_PARAMETERS = [
    "module",
    "data_parallel_group",
    "mem_efficient_linear",
    "remote_device",
    "pin_memory",
    "config_dict_or_path",
    "config",
    "enabled",
    "dtype",
    "mpu",
    "zero_param_parallel_group",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "sequence_data_parallel_group",
    "param_swapper",
    "tensor_overrides",
]


def _messages(**kwargs) -> list[str]:
    forget_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with deepspeed.zero.Init(**kwargs):
            nn.Linear(2, 2)
    return [str(w.message) for w in caught]


def test_the_signature_is_deepspeeds_and_unknown_keywords_raise():
    ours = list(inspect.signature(deepspeed.zero.Init.__init__).parameters)[1:]
    assert ours == DEEPSPEED_INIT_PARAMETERS
    assert list(inspect.signature(real_deepspeed.zero.Init.__init__).parameters)[1:] == ours
    with pytest.raises(TypeError, match="remote_devise"):
        deepspeed.zero.Init(remote_devise="cpu")


def test_init_warns_once_and_names_each_argument_not_acted_on():
    messages = _messages(remote_device="cpu", pin_memory=True)
    assert len(messages) == 3, messages
    assert "zero.Init" in messages[0] and "built as usual" in messages[0]
    assert any("remote_device" in m and "offload_param" in m for m in messages)
    assert any("pin_memory" in m for m in messages)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the second Init says nothing
        deepspeed.zero.Init(remote_device="cpu")


def test_what_is_done_anyway_does_not_warn():
    assert _messages(enabled=False, remote_device="cpu") == []  # off: built as usual
    assert len(_messages(mem_efficient_linear=False, remote_device="none")) == 1  # Init only
    with pytest.raises(ValueError, match="mpu"):
        deepspeed.zero.Init(mpu=object())
