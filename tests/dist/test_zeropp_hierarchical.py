"""Hierarchical qgZ on real gloo ranks: the sum across replica groups, R = 2, 3 and 4.

The across-replica sum is a quantized reduce-scatter then a quantized all-gather of the
summed slices ([Note: quantized all-reduce] in shardwrap/comm/quantized.py). Checked here
against a one-process reference that applies the same quantize -> dequantize -> sum in the
same rank order (so the comparison is bit for bit, on any CPU: every step is a per-value
fp32 operation in a fixed order), with the bytes counted on the ledger and on the wire
(what this rank handed to ``ProcessGroup.send``: gloo's CPU all-gathers and all-to-alls
run as pairwise sends). The byte bound at R = 2..16 is in
tests/unit/test_qgz_hierarchical_bytes.py (torch's fake process group).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwrap
from benchmarks.comm_count import CollectiveCounter
from shardwrap.base.quantize import BlockCodec, dequantize, quantize
from shardwrap.comm import quantized
from shardwrap.comm.collectives import CommLedger, Communicator
from shardwrap.core.grads import UnitGrads
from shardwrap.policies import ModuleWrapPolicy
from tests import models
from tests.dist.harness import run_ranks

NUMEL = 1037  # R does not divide it: the last slice is padded; blocks of 64, the last partial
BLOCK = 64
PAIRWISE_KINDS = ("all_gather", "all_to_all", "reduce_scatter")  # gloo CPU: pairwise sends


# ------------------------------------------------------------ the reference
def _round_trip(values: torch.Tensor, codec: BlockCodec) -> torch.Tensor:
    return dequantize(quantize(values, codec), values.numel(), codec)


def _in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].float().clone()
    for part in parts[1:]:
        total = total + part
    return total


def reference_reduce_scatter(fulls: list[torch.Tensor], position: int, codec: BlockCodec):
    """Slice ``position`` of the sum of ``fulls`` as rank ``position`` forms it: the other
    ranks' slices quantized and dequantized, its own as it is, added in rank order."""
    parts = [full.view(len(fulls), -1)[position] for full in fulls]
    return _in_rank_order(
        [part if r == position else _round_trip(part, codec) for r, part in enumerate(parts)]
    )


def reference_all_reduce(tensors: list[torch.Tensor], codec: BlockCodec) -> torch.Tensor:
    """The sum of ``tensors`` (one per replica) as every replica ends with it."""
    replicas, numel = len(tensors), tensors[0].numel()
    slice_numel = -(-numel // replicas)
    padded = [F.pad(t.float(), (0, replicas * slice_numel - numel)) for t in tensors]
    summed = [reference_reduce_scatter(padded, j, codec) for j in range(replicas)]
    return torch.cat([_round_trip(s, codec) for s in summed])[:numel]


def _target_bytes(numel: int, replicas: int, codec: BlockCodec) -> int:
    """The fp32 ring all-reduce's quantized share: 2 (R-1) chunks of ceil(n/R) values,
    quantized, with one fp32 scale per block."""
    chunk = -(-numel // replicas)
    return 2 * (replicas - 1) * (-(-chunk * codec.bits // 8) + 4 * -(-chunk // codec.block_size))


# ------------------------------------------------------------ the collective
def _all_reduce_worker(rank: int, world_size: int, bits: int, dtype: torch.dtype) -> dict:
    codec = BlockCodec(bits, BLOCK)
    counter = CollectiveCounter()
    counter.install()
    comm = Communicator(dist.group.WORLD, CommLedger())
    # every rank's tensor, its blocks of very different sizes (scales from 1e-3 to 1e2)
    tensors = []
    for r in range(world_size):
        g = torch.Generator().manual_seed(100 + r)
        scale = 10.0 ** torch.randint(-3, 3, (NUMEL,), generator=g).float()
        tensors.append((torch.randn(NUMEL, generator=g) * scale).to(dtype))
    tensor = tensors[rank].clone()
    counter.counting = True
    quantized.all_reduce(comm, tensor, purpose="grads", unit="u", codec=codec).wait()
    counter.counting = False
    return {
        "equal": torch.equal(tensor, reference_all_reduce(tensors, codec).to(dtype)),
        "sent": counter.reset().get("send", (0, 0))[1],
        "ledger_wire": sum(r.wire_bytes for r in comm.ledger.records),
        "kinds": [r.kind for r in comm.ledger.records],
    }


@pytest.mark.parametrize(
    ("bits", "world_size", "dtype"),
    [(8, 2, torch.float32), (8, 3, torch.float32), (8, 4, torch.float32), (4, 4, torch.float32)]
    + [(8, 2, torch.bfloat16)],  # a bf16 reduce dtype: sums in fp32, lands in bf16
)
def test_quantized_all_reduce_matches_the_one_process_reference(
    bits: int, world_size: int, dtype: torch.dtype
) -> None:
    codec = BlockCodec(bits, BLOCK)
    for result in run_ranks(_all_reduce_worker, world_size, bits, dtype):
        assert result["equal"]  # bit for bit, and so the same bits on every rank
        assert result["kinds"] == ["all_to_all", "all_gather"]
        # what went on the wire is what the ledger says, and within the bound
        assert result["sent"] == result["ledger_wire"] > 0
        assert result["sent"] <= _target_bytes(NUMEL, world_size, codec)


# ---------------------------------------------------------- through a model
def _capture_local_grads(seen: dict[str, torch.Tensor]):
    """Wrap qgZ's reduce-scatter to keep each unit's flat local gradient (its input)."""
    original = quantized.reduce_scatter

    def capturing(comm, out_shard, in_full, *, unit: str, **kwargs):
        seen[unit] = in_full.detach().clone()
        return original(comm, out_shard, in_full, unit=unit, **kwargs)

    return original, capturing


def _double_counting(original):
    """A bug put in: the across-replica sum adds this replica's own part twice."""

    def doubled(comm, tensor, **kwargs):
        own = tensor.clone()
        work = original(comm, tensor, **kwargs)

        class _Work:
            def wait(self) -> bool:
                work.wait()
                tensor.add_(own)
                return True

        return _Work()

    return doubled


def _hybrid_backward(rank: int, bug: str, codec: BlockCodec) -> tuple[list, dict, list]:
    """One backward under HYBRID_SHARD in pairs with qgZ, ``bug`` put in ("" for none):
    the handles, each unit's local flat gradient, and the step's ledger records."""
    groups = shardwrap.hybrid_process_groups(2)
    torch.manual_seed(1234)
    model = shardwrap.ShardedModule(
        models.MLP(),
        sharding_strategy="HYBRID_SHARD",
        process_group=groups,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        comm_quantization=shardwrap.CommQuantization(
            gradients=True, gradient_bits=codec.bits, block_size=codec.block_size
        ),
    )
    seen: dict[str, torch.Tensor] = {}
    original, capturing = _capture_local_grads(seen)
    all_reduce, data_parallel_size = quantized.all_reduce, UnitGrads.data_parallel_size
    quantized.reduce_scatter = capturing
    if bug == "double_counted":
        quantized.all_reduce = _double_counting(all_reduce)
    if bug == "no_replica_mean":  # divides by the shard group only, not by every replica
        UnitGrads.data_parallel_size = property(lambda self: self.num_shards)
    model.comm_ledger.reset()
    try:
        models.mlp_loss(model, models.mlp_batch(rank)).backward()
    finally:
        quantized.reduce_scatter, quantized.all_reduce = original, all_reduce
        UnitGrads.data_parallel_size = data_parallel_size
    handles = [u.handle for u in model.units if u.handle is not None]
    return handles, seen, list(model.comm_ledger.records)


def _expected_chunk(handle, fulls: list[torch.Tensor], codec: BlockCodec) -> torch.Tensor:
    """This rank's reduced gradient chunk from every world rank's local flat gradient:
    quantized reduce-scatter in each shard group, quantized all-reduce across them, mean."""
    shard_size, replicas = handle.shard_comm.size, handle.replicate_comm.size
    position = handle.shard_comm.rank
    chunks = [  # world rank g * shard_size + r is rank r of shard group g
        reference_reduce_scatter(fulls[g * shard_size : (g + 1) * shard_size], position, codec)
        for g in range(replicas)
    ]
    return reference_all_reduce(chunks, codec) / (shard_size * replicas)


def _matches_reference(handles, seen: dict[str, torch.Tensor], codec: BlockCodec) -> bool:
    """Whether every shard gradient of this rank is the reference's, bit for bit."""
    matches = True
    for handle in handles:
        local = seen[handle.grads.comm_label]
        fulls = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(fulls, local)
        expected = _expected_chunk(handle, fulls, codec)
        slots = handle.grads.grad_slots
        for index, param in enumerate(handle.shard_params):
            start, end = slots.piece_in_chunk(index, handle.shard_comm.rank)
            if end > start:
                matches &= torch.equal(param.grad.reshape(-1), expected[start:end])
    return matches


def _hybrid_worker(rank: int, world_size: int, bits: int) -> dict:
    codec = BlockCodec(bits, 32)
    counter = CollectiveCounter()
    counter.install()
    out: dict = {}
    for bug in ("", "double_counted", "no_replica_mean"):
        counter.reset()
        counter.counting = True
        handles, seen, records = _hybrid_backward(rank, bug, codec)
        counter.counting = False
        out[bug or "real"] = _matches_reference(handles, seen, codec)
        if not bug:
            sent = counter.reset().get("send", (0, 0))[1]
            pairwise = [r for r in records if r.kind in PAIRWISE_KINDS]
            out["sent"], out["ledger_wire"] = sent, sum(r.wire_bytes for r in pairwise)
            out["kinds"] = sorted({(r.kind, r.purpose) for r in records})
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_hybrid_qgz_gradients_match_the_one_process_reference(bits: int) -> None:
    """2 shard groups of 2 (R = 2, world 4): every shard gradient equals the reference's
    bit for bit; a sum that double-counts or a mean that forgets the replicas does not."""
    for result in run_ranks(_hybrid_worker, 4, bits):
        assert result["real"]
        assert not result["double_counted"] and not result["no_replica_mean"]
        assert ("all_reduce", "grads") not in result["kinds"]
        assert ("reduce_scatter", "grads") not in result["kinds"]
        # the wire carries what the ledger says, every pairwise collective of the backward
        assert result["sent"] == result["ledger_wire"] > 0
