"""Hierarchical qgZ's bytes per rank at R = 2, 4, 8 and 16 replicas (torch's fake process group).

One process plays one rank (``backend="fake"``: collectives return at once, moving nothing;
only the bytes are looked at). What a rank receives is counted from the tensors handed to
``torch.distributed`` (``benchmarks/bench_qgz_hierarchical.py``'s ``ReceivedCounter``) and
compared with the ledger and with the bound: the fp32 ring all-reduce's quantized share,
``2 (R-1)`` chunks of ``ceil(n / R)`` quantized values plus one fp32 scale per block
([Note: quantized all-reduce] in shardwrap/comm/quantized.py). The values themselves are
checked on real gloo ranks in tests/dist/test_zeropp_hierarchical.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwrap
from benchmarks import bench_qgz_hierarchical as bench
from shardwrap import profile
from shardwrap.base.quantize import BlockCodec
from shardwrap.comm.ledger import CommRecord
from shardwrap.policies import ModuleWrapPolicy
from tests import models

NUMEL = 5003  # a prime: no R divides it
REPLICAS = (2, 4, 8, 16)
FP32_BYTES = 4
SCALE_BYTES = 4


def _target_bytes(numel: int, replicas: int, codec: BlockCodec) -> int:
    """The fp32 ring all-reduce (2 (R-1) chunks of ceil(n/R) values) with each chunk's
    values quantized to ``codec.bits`` (whole bytes) and one fp32 scale per block."""
    chunk = -(-numel // replicas)
    values = -(-chunk * codec.bits // 8)
    scales = -(-chunk // codec.block_size) * SCALE_BYTES
    return 2 * (replicas - 1) * (values + scales)


def _plain_all_reduce_wire(numel: int, replicas: int) -> float:
    """What the ledger counts per rank for the plain fp32 all-reduce of ``numel`` values."""
    return CommRecord("all_reduce", "grads", numel * FP32_BYTES, replicas).wire_bytes


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("replicas", REPLICAS)
def test_bytes_per_rank_stay_at_the_fp32_all_reduces_quantized_share(replicas: int, bits: int):
    codec = BlockCodec(bits, 64)
    got = bench.measure(replicas, NUMEL, codec)
    assert 0 < got["received"] <= _target_bytes(NUMEL, replicas, codec)
    assert got["received"] == got["ledger_wire"]  # the ledger counts what was handed over
    # the saving is reckoned against the plain all-reduce: 8 n (R-1) / R per rank
    assert got["ledger_unquantized_wire"] == _plain_all_reduce_wire(NUMEL, replicas)
    assert got["ledger_unquantized_wire"] == 8 * NUMEL * (replicas - 1) / replicas


@pytest.mark.parametrize("replicas", [4, 8, 16])
def test_gathering_every_row_fails_the_bound(replicas: int) -> None:
    """The negative control: the design the all-reduce replaced (every replica's whole
    quantized row all-gathered) exceeds the bound from R = 4, and at R = 16 receives
    more than the fp32 all-reduce itself."""
    codec = BlockCodec(8, 64)
    old = bench.measure(replicas, NUMEL, codec, reduce=bench.gather_every_row)["received"]
    assert old > _target_bytes(NUMEL, replicas, codec)
    if replicas == 16:
        assert old > _plain_all_reduce_wire(NUMEL, replicas)


# ---------------------------------------------------------- through a model
SHARD_SIZE = 3  # not a power of two: the shard and replica groups never share a size


def _backward(replicas: int, quantization) -> tuple[list, profile.StepProfile, dict, list]:
    """One backward of an MLP under HYBRID_SHARD (shard groups of 3, ``replicas`` of
    them) as world rank 4 (shard rank 1 of replica 1); its handles' chunk sizes, the
    profile, the bytes received by group size and the ledger records."""
    with bench.fake_ranks(SHARD_SIZE * replicas, rank=4):
        groups = shardwrap.hybrid_process_groups(SHARD_SIZE)
        model = shardwrap.ShardedModule(
            models.MLP(),
            sharding_strategy="HYBRID_SHARD",
            process_group=groups,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            comm_quantization=quantization,
        )
        model.comm_ledger.reset()
        with bench.ReceivedCounter() as counter, profile.profile_step(model) as step:
            loss = models.mlp_loss(model, models.mlp_batch(0))
            torch.nan_to_num(loss).backward()  # the fake gathers left garbage weights
        chunks = [u.handle.grads.grad_slots.chunk_numel for u in model.units if u.handle]
        return chunks, step, counter.by_group_size, list(model.comm_ledger.records)


@pytest.mark.parametrize("replicas", REPLICAS)
def test_hybrid_shard_reduction_stays_within_the_bound_through_a_model(replicas: int) -> None:
    codec = BlockCodec(8, 64)
    quantization = shardwrap.CommQuantization(gradients=True, block_size=codec.block_size)
    chunks, step, received, records = _backward(replicas, quantization)
    across = [r for r in records if r.purpose == "grads" and r.group_size == replicas]
    assert sorted({r.kind for r in across}) == ["all_gather", "all_to_all"]
    assert len(across) == 2 * len(chunks)  # two passes per unit
    assert received[replicas] == sum(r.wire_bytes for r in across)
    assert received[replicas] <= sum(_target_bytes(c, replicas, codec) for c in chunks)

    # the profile's saving is against what the same model sends unquantized
    _, plain_step, _, plain_records = _backward(replicas, None)
    plain_across = [r for r in plain_records if r.kind == "all_reduce" and r.purpose == "grads"]
    # byte counts through + * / of Python floats: IEEE's correctly rounded operations give
    # the same bits on every machine, so equal here is equal everywhere
    unquantized = sum(r.unquantized_wire_bytes for r in across)
    assert unquantized == sum(r.wire_bytes for r in plain_across)
    grads_wire = sum(s.wire_bytes for s in step.collectives if s.purpose == "grads")
    plain_wire = sum(s.wire_bytes for s in plain_step.collectives if s.purpose == "grads")
    assert step.saved_wire_bytes() == plain_wire - grads_wire
    assert plain_wire > grads_wire > 0
