"""The planner under tensor and pipeline parallelism: 16 P / (TP PP DP) at ZeRO-3."""

from __future__ import annotations

import pytest
from torch import nn

from shardwrap.__main__ import main
from shardwrap.layout.flat import padded_numel
from shardwrap.planner import estimate_memory

P = 12_000_000


@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 8), (2, 1, 4), (2, 2, 2), (4, 2, 3)])
def test_zero3_model_state_is_16p_over_tp_pp_dp(tp, pp, dp):
    largest = 1_000_003  # one layer; the rest of the rank's share is the root unit
    est = estimate_memory(
        P,
        world_size=dp,
        stage=3,
        largest_unit_params=largest,
        tensor_parallel=tp,
        pipeline_parallel=pp,
    )
    share = -(-P // (tp * pp))
    layer = -(-largest // tp)
    padded = padded_numel(layer, dp) + padded_numel(share - layer, dp)
    # fp32 AdamW: 4 B parameter shard + 4 B gradient shard + 8 B moments per element.
    assert est.model_state_bytes == 16 * padded // dp
    assert padded - share < 2 * dp  # padding only
    assert est.bytes("gathered_parameters") <= 2 * 4 * padded_numel(layer, dp)


def test_model_parallel_degrees_are_checked():
    with pytest.raises(ValueError, match="tensor_parallel"):
        estimate_memory(P, world_size=2, stage=3, tensor_parallel=0)
    with pytest.raises(ValueError, match="pipeline_parallel"):
        estimate_memory(P, world_size=2, stage=3, pipeline_parallel=True)
    with pytest.raises(ValueError, match="only for a parameter count"):
        estimate_memory(nn.Linear(4, 4), world_size=2, stage=3, tensor_parallel=2)


def test_estimate_command_takes_tp_and_pp(capsys):
    assert main(["estimate", "--params", "7e9", "--world-size", "4", "--tp", "8", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "TP 8 x PP 4" in out and "218,750,000 of the 7,000,000,000" in out
    alone = estimate_memory(7e9, world_size=4, stage=3).model_state_bytes
    split = estimate_memory(
        7e9, world_size=4, stage=3, tensor_parallel=8, pipeline_parallel=4
    ).model_state_bytes
    assert abs(split * 32 - alone) < 16 * 32 * 8  # a 32nd, but for padding
    with pytest.raises(SystemExit, match="--tp"):
        main(["estimate", "--params", "7e9", "--world-size", "4", "--tp", "0"])
