"""The planner for a parameter count: the assumed decoder, the ZeRO paper's formulas, and
the worst rank found without visiting every rank."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwrap.__main__ import main
from shardwrap.planner.estimate import cheapest_fitting, estimate_memory
from shardwrap.planner.shapes import assumed_shape

WORLD_SIZES = st.sampled_from([8, 16, 24, 64, 100, 256, 1000, 1024, 2048, 4096])
COUNTS = st.integers(min_value=10**8, max_value=10**12)


@pytest.mark.parametrize(
    "count,hidden,layers",
    [(125e6, 768, 17), (1.3e9, 2048, 25), (7e9, 4096, 34), (13e9, 5120, 41), (70e9, 8192, 86)],
)
def test_assumed_shape_from_the_table(count, hidden, layers):
    shape = assumed_shape(int(count))
    assert (shape.hidden, shape.num_layers, shape.layer_params) == (
        hidden,
        layers,
        12 * hidden**2,
    )
    assert 0 <= shape.root_params < shape.layer_params  # layers: P // (12 h^2)


def test_assumed_shape_rule_given_and_small():
    assert assumed_shape(175 * 10**9).hidden == 12288  # the rule meets the table's last row
    assert assumed_shape(10**12).hidden == 22016
    assert assumed_shape(7 * 10**9, hidden=5120).layer_params == 12 * 5120**2
    assert assumed_shape(7 * 10**9, layers=32).hidden == 4269  # isqrt(7e9 // 384)
    assert assumed_shape(10**6).hidden == 64  # below the table: 12 layers of a multiple of 64
    tiny = assumed_shape(1000)
    assert (tiny.hidden, tiny.layer_params, tiny.num_layers) == (0, 1000, 1)
    with pytest.raises(ValueError, match="layers, hidden"):
        assumed_shape(10**9, layers=100, hidden=4096)
    with pytest.raises(ValueError, match="hidden"):
        assumed_shape(10**6, hidden=4096)


def _paper(num_params: int, n: int) -> dict[int, float]:
    """The ZeRO paper's model-state bytes per rank, mixed-precision Adam (K = 12)."""
    return {
        1: 4 * num_params + 12 * num_params / n,
        2: 2 * num_params + 14 * num_params / n,
        3: 16 * num_params / n,
    }


@settings(max_examples=60, deadline=None)
@given(num_params=COUNTS, n=WORLD_SIZES, bf16=st.booleans())
def test_stage3_is_16_bytes_per_param_over_n_plus_two_layers(num_params, n, bf16):
    compute = torch.bfloat16 if bf16 else None
    est = estimate_memory(num_params, world_size=n, stage=3, compute_dtype=compute)
    padding = 2 * n  # two units, each padded to a multiple of N
    assert 16 * num_params / n <= est.model_state_bytes <= 16 * (num_params + padding) / n
    assert 0 <= est.model_state_bytes - _paper(num_params, n)[3] <= 16 * padding / n
    layer = assumed_shape(num_params).layer_params
    gathered = -(-layer // n) * n * (2 if bf16 else 4)
    assert est.bytes("gathered_parameters") == (2 * gathered if layer < num_params else gathered)
    assert est.device_bytes == est.model_state_bytes + est.bytes("gathered_parameters")


@settings(max_examples=60, deadline=None)
@given(num_params=COUNTS, n=WORLD_SIZES)
def test_stages_1_and_2_against_the_paper(num_params, n):
    """shardwrap holds 2P + 16P/N at stages 1 and 2 (the paper: 4P + 12P/N, 2P + 14P/N):
    gradients are reduced to shards in backward at stage 1 too, and the shard handed to the
    optimizer is fp32 (2P/N more than the paper's fp16 gradient shard)."""
    stages = estimate_memory(num_params, world_size=n, compute_dtype=torch.bfloat16)
    paper = _paper(num_params, n)
    slack = 2 * 2 * n + 16 * 2  # two units padded: the bf16 copy and 16 bytes per shard element
    for est in stages[1:3]:
        assert 0 <= est.device_bytes - (2 * num_params + 16 * num_params / n) <= slack
        assert est.bytes("gathered_parameters") >= 2 * num_params  # the whole bf16 copy
    assert 0 <= stages[2].device_bytes - (paper[2] + 2 * num_params / n) <= slack
    assert 0 <= stages[1].device_bytes - (paper[1] - 2 * num_params + 4 * num_params / n) <= slack


def _table_row(out: str, label: str) -> list[str]:
    return next(line for line in out.splitlines() if line.startswith(label)).split()[-4:]


def test_headline_7e9_on_8_ranks(capsys):
    assert main(["estimate", "--params", "7e9", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "assumed: 34 decoder layers of 12 x hidden^2 = 201,326,592 parameters" in out
    assert _table_row(out, "= sharded model state")[3] == "13.039"  # 16P/N = 14e9 bytes
    assert _table_row(out, "gathered_parameters")[3] == "1.500"  # 2 layers, fp32
    assert "(chain + next unit) c = (201,326,592 + 201,326,592) x 4" in out


def test_70b_on_1024_ranks_fits_80gb_with_zero3(capsys):
    argv = ["estimate", "--params", "70e9", "--world-size", "1024", "--bf16", "--budget", "80GB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert _table_row(out, "= sharded model state")[3] == "1.019"  # the paper's 16P/N
    assert "cheapest stage that fits 74.506 GiB per rank: stage 3" in out
    stages = estimate_memory(70 * 10**9, world_size=1024, compute_dtype=torch.bfloat16)
    assert cheapest_fitting(stages, 80 * 10**9).stage == 3


def test_layers_and_hidden_options(capsys):
    main(["estimate", "--params", "7e9", "--world-size", "8", "--hidden", "5120"])
    assert "hidden 5120 (given)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not both"):
        main(
            [
                "estimate",
                "--params",
                "7e9",
                "--world-size",
                "8",
                "--layers",
                "32",
                "--largest-unit-params",
                "2e8",
            ]
        )
    with pytest.raises(SystemExit, match="--layers, hidden"):
        main(
            [
                "estimate",
                "--params",
                "1e9",
                "--world-size",
                "8",
                "--layers",
                "100",
                "--hidden",
                "4096",
            ]
        )
