"""``--lift-gpu-gates``: run torch's FSDP1 tests that gate on accelerators on CPU ranks.

torch's FSDP1 test files (``test/distributed/fsdp``) mark nearly every test
``skip_if_lt_x_gpu(n)`` without ``allow_cpu``, gate the ones that use a dummy process group
on ``TEST_MULTIGPU``, and instantiate their device-generic classes ``only_for`` accelerator
types; on a CPU-only machine every such test skips or is never made, under torch's FSDP as
under shardwrap. Yet their bodies run on CPU: ``common_fsdp`` picks ``DEVICE_TYPE = "cpu"``
and the gloo backend, and its DDP reference takes a CPU module. With this option, in every
process of the run (both columns alike, before any test module is imported):

- ``common_distributed.skip_if_lt_x_gpu(n)`` behaves as ``skip_if_lt_x_gpu(n,
  allow_cpu=True)``: it still skips on a machine whose accelerators are too few, and runs
  where there are none;
- ``common_cuda.TEST_MULTIGPU`` reads ``True`` where there is no accelerator (only test
  files read it);
- ``common_device_type.instantiate_device_type_tests(..., only_for=...)`` also makes the
  CPU class where there is no accelerator.

Tests that call CUDA themselves still fail or skip on their own (``TEST_CUDA``,
``torch.accelerator.is_available()`` gates are left alone). The control column says which
tests torch's FSDP passes this way; the shardwrap column runs the same tests.
"""

from __future__ import annotations

import functools


def _no_accelerator() -> bool:
    import torch

    return not torch.accelerator.is_available()


def lift_device_gates() -> None:
    """Patch the three gates named in the module doc (a no-op where an accelerator is)."""
    if not _no_accelerator():
        return
    from torch.testing._internal import common_cuda, common_device_type, common_distributed

    real_skip = common_distributed.skip_if_lt_x_gpu

    @functools.wraps(real_skip)
    def skip_if_lt_x_gpu(x, *, allow_cpu=False):
        return real_skip(x, allow_cpu=True)

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    common_cuda.TEST_MULTIGPU = True

    real_instantiate = common_device_type.instantiate_device_type_tests

    @functools.wraps(real_instantiate)
    def instantiate_device_type_tests(generic_test_class, scope, *args, **kwargs):
        only_for = kwargs.get("only_for")
        if only_for is not None:
            only = [only_for] if isinstance(only_for, str) else list(only_for)
            if "cpu" not in only:
                kwargs["only_for"] = [*only, "cpu"]
        return real_instantiate(generic_test_class, scope, *args, **kwargs)

    common_device_type.instantiate_device_type_tests = instantiate_device_type_tests


def default_fsdp1_cpu_device_id() -> None:
    """``--fsdp1-cpu-device-id``: torch's FSDP1 built without ``device_id`` takes ``"cpu"``.

    On a machine without accelerators torch's ``FullyShardedDataParallel(module)`` raises
    "FSDP needs a non-CPU accelerator device" unless the call passes ``device_id="cpu"``
    (``_init_device_handle``); torch's newer FSDP1 tests pass it, many older ones do not.
    This wraps the ``__init__`` of torch's class (not the name: where ``shardwrap.install()``
    rebound the name, torch's class is never built) to fill in ``device_id=cpu`` when the
    caller gave none. A no-op where an accelerator is.
    """
    if not _no_accelerator():
        return
    import inspect

    import torch
    from torch.distributed.fsdp import fully_sharded_data_parallel as fsdp1

    cls = fsdp1.FullyShardedDataParallel
    if not cls.__module__.startswith("torch."):
        raise RuntimeError(f"expected torch's FSDP1 class, found {cls!r} (call before install())")
    real_init = cls.__init__
    signature = inspect.signature(real_init)

    @functools.wraps(real_init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("device_id") is None:
            bound.arguments["device_id"] = torch.device("cpu")
        real_init(*bound.args, **bound.kwargs)

    cls.__init__ = __init__
