"""The FSDP2 door's ``offload_policy=CPUOffloadPolicy(...)``, against torch's FSDP2.

The script of tests/dist/fsdp2_cases.py runs with every call offloading, and with only
the blocks' calls offloading (each call carries its own policy), under torch's
``fully_shard`` and shardwrap's on a CPU mesh at 2 gloo ranks, compared bit for bit:
losses, gradient norms, every parameter's ``full_tensor()``, local shapes, placements,
``state_dict()``. torch's FSDP2 runs CPUOffloadPolicy on a CPU mesh (its host-to-device
copies are CPU-to-CPU there), so the reference is torch itself. shardwrap's offloading
units keep host shards (``HostStaging``, unpinned as pin_memory=False asks) and the
others do not. Without CUDA, ``CPUOffloadPolicy()`` (pin_memory=True) fails in torch's
``fully_shard`` (pinning needs an accelerator); shardwrap's refuses it with a
ValueError naming pin_memory.

Negative control (in the suite): the offload path taken, but the host copy of the
gradients stale after the first step (``StaleHostGrads``): the comparison fails from
step 1 on (losses, gradient norms, parameters). Run once: the door's ``cpu_offload``
not handed to the engine (``_wrap_options`` passing None) keeps the numbers equal, as
offload must, and fails both comparisons on the host-staging check ("root: host staging
None for offload 'cpu'", and the blocks').
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import fsdp2_cases as fc
from tests.dist import fsdp2_offload_cases as oc
from tests.dist.harness import run_ranks

ALL_OFFLOADED = fc.Script(offload="cpu", root_offload="cpu")
BLOCKS_OFFLOADED = fc.Script(offload="cpu")


@pytest.mark.parametrize("script", [ALL_OFFLOADED, BLOCKS_OFFLOADED], ids=["all", "blocks"])
def test_cpu_offload_equals_torch_fsdp2_bit_for_bit(script):
    for rank, found in enumerate(run_ranks(oc.compare, 2, script, False)):
        assert found == [], f"rank {rank}: {found[:8]}"


def test_negative_control_stale_host_gradients_differ():
    for found in run_ranks(oc.compare, 2, ALL_OFFLOADED, True):
        assert any("step 1: grad norm" in line for line in found), found[:8]
        assert not any(line.startswith("step 0") for line in found), found[:8]


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins host memory where CUDA is available")
def test_pinned_offload_without_cuda_is_refused_where_torch_fails():
    for found in run_ranks(oc.pinning_without_cuda, 2):
        assert found["torch"].startswith("RuntimeError"), found
        assert found["shardwrap"].startswith("ValueError"), found
        assert "pin_memory=False" in found["shardwrap"], found
