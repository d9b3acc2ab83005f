"""``--cpu-ranks``: let torch 2.13's multi-process FSDP tests start their ranks on a CPU-only
machine.

torch's ``FSDPTest`` starts each rank by comparing ``torch.accelerator.device_count()`` with
the test's world size and exits the rank as skipped when there are fewer accelerators; on a
machine with none that skips every multi-process test, also those torch marks
``skip_if_lt_x_gpu(n, allow_cpu=True)``, which are written to run on gloo CPU ranks (the
threaded ``FSDPTestMultiThread`` has no such gate on CPU). This answers that one comparison
(the rank's first ``device_count()`` call) with "enough" and then puts the real function
back, so every later call, the tests' own and their ``skip_if_lt_x_gpu`` included, sees the
real count. Applied in both columns alike.
"""

from __future__ import annotations

import torch

ENOUGH = 1 << 16


def _once_enough() -> None:
    real = torch.accelerator.device_count

    def first_call() -> int:
        torch.accelerator.device_count = real
        return ENOUGH

    torch.accelerator.device_count = first_call


def allow_cpu_ranks() -> None:
    """Wrap ``FSDPTest._run`` and ``FSDPTestContinuous._init_pg`` (each rank's entry) so that
    their accelerator gate passes once."""
    from torch.testing._internal import common_fsdp

    if common_fsdp.DEVICE_TYPE != "cpu":
        return
    run_rank = common_fsdp.FSDPTest._run.__func__

    def _run(cls, *args, **kwargs):
        _once_enough()
        return run_rank(cls, *args, **kwargs)

    common_fsdp.FSDPTest._run = classmethod(_run)

    # FSDPTestContinuous (newer FSDP1 test files: one set of worker ranks per class)
    # makes the same comparison as the first thing its worker does, in _init_pg.
    continuous = getattr(common_fsdp, "FSDPTestContinuous", None)
    if continuous is None:
        return
    init_pg = continuous._init_pg.__func__

    def _init_pg(cls, *args, **kwargs):
        _once_enough()
        return init_pg(cls, *args, **kwargs)

    continuous._init_pg = classmethod(_init_pg)
