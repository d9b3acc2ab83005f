"""CommQuantization (ZeRO++'s switches): its checks and the codecs it hands out."""

from __future__ import annotations

import pytest

from shardwrap import CommQuantization
from shardwrap.base.quantize import BlockCodec


def test_codecs_follow_the_switches() -> None:
    config = CommQuantization(weights=True, gradients=True, gradient_bits=4, block_size=64)
    assert config.weight_codec == BlockCodec(8, 64)
    assert config.gradient_codec == BlockCodec(4, 64)
    assert config.enabled
    off = CommQuantization()
    assert off.weight_codec is None and off.gradient_codec is None and not off.enabled
    assert CommQuantization(hpz_partition_size=2).enabled


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"weights": 1}, TypeError, "weights"),
        ({"gradients": "yes"}, TypeError, "gradients"),
        ({"weight_bits": 16}, ValueError, "weight_bits"),
        ({"gradient_bits": 2}, ValueError, "gradient_bits"),
        ({"gradient_bits": True}, ValueError, "gradient_bits"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": 33}, ValueError, "block_size"),
        ({"block_size": 32.0}, TypeError, "block_size"),
        ({"hpz_partition_size": 0}, ValueError, "hpz_partition_size"),
        ({"hpz_partition_size": -1}, ValueError, "hpz_partition_size"),
    ],
)
def test_bad_fields_are_refused_by_name(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        CommQuantization(**kwargs)


def test_parse_accepts_only_the_record() -> None:
    config = CommQuantization(weights=True)
    assert CommQuantization.parse(config) is config
    assert CommQuantization.parse(None) is None
    with pytest.raises(TypeError, match="comm_quantization"):
        CommQuantization.parse({"weights": True})
