"""Host tensors reduced over a group without a CPU transport travel through a staged copy."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwrap.comm.collectives import CommLedger, Communicator, backend_handles_cpu
from tests.dist.harness import run_ranks


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("gloo", True), ("nccl", False), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl", False)],
)
def test_backend_handles_cpu(backend: str, expected: bool) -> None:
    assert backend_handles_cpu(backend) is expected


def staged_worker(rank: int, world_size: int) -> None:
    comm = Communicator(dist.group.WORLD, CommLedger())
    assert comm.host_capable  # gloo
    # Pretend the backend were accelerator-only; the "accelerator" here is the CPU again,
    # so the staged copy is a distinct tensor the result must be copied back from.
    comm.host_capable = False
    comm.staging_device = torch.device("cpu")
    flags = torch.tensor([float(rank), 1.0 - rank, 5.0])
    comm.all_reduce(flags, purpose="test", op=dist.ReduceOp.MAX).wait()
    assert flags.tolist() == [1.0, 1.0, 5.0]
    total = torch.tensor([rank + 1.0])
    comm.all_reduce(total, purpose="test").wait()
    assert total.item() == world_size * (world_size + 1) / 2
    value = torch.tensor([10.0 * (rank + 1)])
    comm.broadcast(value, src_rank=1, purpose="test").wait()
    assert value.item() == 20.0
    assert comm.ledger.count("all_reduce", "test") == 2


def test_host_tensors_staged_and_copied_back() -> None:
    run_ranks(staged_worker, 2)
