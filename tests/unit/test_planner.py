"""The planner's arithmetic from a parameter count, and the ``estimate`` command."""

from __future__ import annotations

import pytest
import torch

from shardwrap.__main__ import main
from shardwrap.planner.cli import parse_bytes
from shardwrap.planner.estimate import Location, cheapest_fitting, estimate_memory, format_table
from shardwrap.policies import ModuleWrapPolicy

P, N = 7_000_000_000, 8


def test_count_formulas_per_stage():
    stages = estimate_memory(P, world_size=N)
    by_stage = {e.stage: e for e in stages}
    assert [e.stage for e in stages] == [0, 1, 2, 3]
    # DeepSpeed-style sanity: fp32 AdamW with nothing sharded is 16 bytes per parameter.
    assert by_stage[0].device_bytes == 16 * P
    assert by_stage[1].bytes("optimizer_state") == 2 * 4 * P // N
    assert by_stage[1].bytes("gradients") == 4 * P // N  # ZeRO-1 reduces in backward
    assert by_stage[2].bytes("gradients") == 4 * P // N
    layer = 12 * 4096**2  # the assumed unit: one decoder layer of a 7e9 model
    assert by_stage[3].bytes("gathered_parameters") == 2 * 4 * layer  # computing + prefetched
    whole = estimate_memory(P, world_size=N, stage=3, largest_unit_params=P)
    assert whole.bytes("gathered_parameters") == 4 * P  # one unit: the whole model
    small = estimate_memory(P, world_size=N, stage=3, largest_unit_params=200_000_000)
    assert small.bytes("gathered_parameters") == 2 * 4 * 200_000_000  # one more prefetched
    assert small.device_bytes == 4 * P // N * 4 + 2 * 4 * 200_000_000
    no_prefetch = estimate_memory(
        P, world_size=N, stage=3, largest_unit_params=200_000_000, backward_prefetch=False
    )
    assert no_prefetch.bytes("gathered_parameters") == 4 * 200_000_000


def test_padding_and_dtype():
    odd = estimate_memory(10, world_size=3, stage=3, param_dtype=torch.bfloat16)
    assert odd.bytes("parameters") == 4 * 2  # 10 padded to 12, 4 per rank, 2 bytes each
    assert estimate_memory(10, world_size=3, stage=3, rank=2).bytes("gradients") == 2 * 4
    assert (
        estimate_memory(10, world_size=3, stage=3, optimizer="sgd").bytes("optimizer_state")
        == 4 * 4
    )


def test_mixed_precision_keeps_fp32_master_and_state():
    mixed = estimate_memory(P, world_size=N, stage=1, compute_dtype=torch.bfloat16)
    assert mixed.bytes("parameters") == 4 * P // N and mixed.bytes("optimizer_state") == 8 * P // N
    assert mixed.bytes("gathered_parameters") == 2 * P  # the bf16 working copy
    assert mixed.bytes("gradients") == 4 * P // N  # ZeRO-1: fp32 shards, reduced in backward
    one_rank = estimate_memory(P, world_size=1, stage=0, compute_dtype=torch.bfloat16)
    assert one_rank.bytes("gathered_parameters") == 2 * P  # a cast copy even with one shard


def test_offload_moves_categories_off_the_device():
    plain = estimate_memory(P, world_size=N, stage=3)
    cpu = estimate_memory(P, world_size=N, stage=3, offload="cpu")
    disk = estimate_memory(P, world_size=N, stage=3, offload="disk")
    shard_and_state = plain.bytes("parameters") + plain.bytes("optimizer_state")
    assert cpu.bytes_at(Location.HOST) == shard_and_state + plain.bytes("gradients")
    # DiskOffload keeps the gradients handed to the optimizer in files too.
    on_disk = shard_and_state + plain.bytes("gradients")
    assert disk.bytes_at(Location.DISK) == on_disk == 16 * P // N
    assert disk.device_bytes == plain.device_bytes - 16 * P // N


def test_cheapest_stage_that_fits():
    stages = estimate_memory(P, world_size=N, largest_unit_params=200_000_000)
    assert cheapest_fitting(stages, 80 * 10**9).stage == 1
    assert cheapest_fitting(stages, 20 * 2**30).stage == 3
    assert cheapest_fitting(stages, 2**30) is None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "stage": 4}, "stage: expected 0, 1, 2 or 3"),
        ({"world_size": 2, "stage": 1, "strategy": "FULL_SHARD"}, "not both"),
        ({"world_size": 2, "optimizer": "lamb"}, "optimizer: expected one of"),
        ({"world_size": 2, "offload": "nvme"}, "offload: expected"),
        ({"world_size": 2, "strategy": "HYBRID_SHARD"}, "not modelled"),
        ({"world_size": 2, "largest_unit_params": 10**12}, "largest_unit_params"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(P, **kwargs)


def test_estimate_command(capsys):
    assert main(["estimate", "--params", "7e9", "--world-size", "8", "--budget", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "stage 3 FULL_SHARD" in out and "k T b / N = 2 x 875,000,000 x 4" in out
    assert "cheapest stage that fits 74.506 GiB per rank: stage 1" in out
    assert main(["estimate", "--params", "7e9", "--world-size", "8", "--budget", "1GiB"]) == 1
    assert "no stage fits" in capsys.readouterr().out
    main(["estimate", "--params", "1e9", "--world-size", "4", "--bf16", "--offload", "disk"])
    assert "(disk)" in capsys.readouterr().out


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5 GiB") == 3 * 2**29
    with pytest.raises(Exception, match="--budget"):
        parse_bytes("lots")


def test_hpz_secondary_is_p_c_over_g_at_stage_3_only() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    policy = ModuleWrapPolicy({torch.nn.Linear})
    stages = estimate_memory(model, world_size=8, auto_wrap_policy=policy, hpz_partition_size=4)
    # four units of 64*64+64 = 4,160 elements, padded to 4,160 (a multiple of 8): 1/4 each
    assert stages[3].bytes("hpz_secondary") == 4 * (4160 // 4) * 4
    assert [e.bytes("hpz_secondary") for e in stages[:3]] == [0, 0, 0]
    off = estimate_memory(model, world_size=8, stage=3, hpz_partition_size=1)  # 1 is off
    assert off.bytes("hpz_secondary") == 0
    assert "hpz_secondary" in format_table(stages)
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="hpz_partition_size"):
            estimate_memory(model, world_size=8, stage=3, hpz_partition_size=bad)
