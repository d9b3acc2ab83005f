"""The host-offload staging helpers, on their own (CPU: host and device are the same)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import shardwrap
from shardwrap.deepspeed.engine_parts import _check_prewrapped_offload
from shardwrap.offload.host import HostStaging, host_staging_for
from shardwrap.planner.estimate import Location, estimate_memory

CPU = torch.device("cpu")


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_pinned_only_with_cuda() -> None:
    staging = HostStaging.for_this_process()
    assert staging.pin_memory == torch.cuda.is_available()
    buffer = staging("unit", 7, torch.float32)
    assert buffer.shape == (7,) and buffer.dtype == torch.float32 and buffer.device == CPU
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory: True needs CUDA"):
            HostStaging(pin_memory=True)
    with pytest.raises(TypeError, match="pin_memory"):
        HostStaging(pin_memory=1)  # type: ignore[arg-type]


def test_to_device_is_a_copy_even_on_cpu() -> None:
    staging = HostStaging.for_this_process()
    host = torch.randn(11)
    staged = staging.to_device(host, CPU, torch.float32)
    staged.wait_copied()
    assert not _shares_memory(staged.tensor, host)
    torch.testing.assert_close(staged.tensor, host, rtol=0, atol=0)
    host.add_(1.0)  # a later optimizer step does not reach the staged copy
    assert not torch.equal(staged.tensor, host)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_to_device_casts_exactly_like_a_plain_cast(dtype: torch.dtype) -> None:
    host = torch.randn(64) * 3
    staged = HostStaging.for_this_process().to_device(host, CPU, dtype)
    assert staged.tensor.dtype == dtype
    torch.testing.assert_close(staged.tensor, host.to(dtype), rtol=0, atol=0)


def test_to_host_is_a_flat_copy() -> None:
    staging = HostStaging.for_this_process()
    grad = torch.randn(3, 4)
    host = staging.to_host(grad)
    assert host.shape == (12,) and host.device == CPU and not _shares_memory(host, grad)
    torch.testing.assert_close(host, grad.reshape(-1), rtol=0, atol=0)


def test_which_options_stage() -> None:
    assert host_staging_for(None) is None
    assert host_staging_for(shardwrap.CPUOffload()) is None
    assert host_staging_for(shardwrap.CPUOffload(offload_params=True)) == HostStaging(
        pin_memory=torch.cuda.is_available()
    )
    assert host_staging_for(shardwrap.DiskOffload("/tmp")) is None


def test_an_explicit_pin_memory_is_honoured() -> None:
    """The FSDP2 door's CPUOffloadPolicy(pin_memory=False) stays unpinned even with CUDA;
    True without CUDA is refused. Negative control: pin_memory=None follows CUDA."""
    unpinned = shardwrap.CPUOffload(offload_params=True, pin_memory=False)
    assert host_staging_for(unpinned) == HostStaging(pin_memory=False)
    pinned = shardwrap.CPUOffload(offload_params=True, pin_memory=True)
    if torch.cuda.is_available():
        assert host_staging_for(pinned) == HostStaging(pin_memory=True)
    else:
        with pytest.raises(ValueError, match="pin_memory"):
            host_staging_for(pinned)
    with pytest.raises(TypeError, match="pin_memory"):
        shardwrap.CPUOffload(offload_params=True, pin_memory="yes")


def test_planner_counts_the_device_copy_of_one_shard() -> None:
    num_params = 10**6
    # Every stage, ZeRO-1 included (it reduces in backward), hands host gradients to the step.
    for stage in (0, 1, 2):
        plain = estimate_memory(num_params, world_size=4, stage=stage)
        offloaded = estimate_memory(num_params, world_size=4, stage=stage, offload="cpu")
        device_copy = 4 * num_params if stage == 0 else plain.bytes("gathered_parameters")
        assert offloaded.bytes("gathered_parameters") == device_copy, stage
        gradients = next(i for i in offloaded.items if i.category == "gradients")
        assert gradients.location is Location.HOST, stage
        host = offloaded.bytes_at(Location.HOST)
        categories = ("parameters", "optimizer_state", "gradients")
        assert host == sum(offloaded.bytes(c) for c in categories), stage


def test_engine_refuses_a_wrapped_device_model_without_host_shards() -> None:
    on_device = SimpleNamespace(
        cpu_offload=None, parameters=lambda: [torch.empty(1, device="meta")]
    )
    with pytest.raises(ValueError, match="offload to cpu.*CPUOffload\\(offload_params=True\\)"):
        _check_prewrapped_offload(on_device, shardwrap.CPUOffload(offload_params=True))
    on_host = SimpleNamespace(cpu_offload=None, parameters=lambda: [torch.empty(1)])
    _check_prewrapped_offload(on_host, shardwrap.CPUOffload(offload_params=True))  # a no-op
    with pytest.raises(ValueError, match="give an unwrapped model"):
        _check_prewrapped_offload(on_host, shardwrap.DiskOffload("/tmp"))
