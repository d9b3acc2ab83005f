"""Started by every Python process the torch suite runs (this folder is on PYTHONPATH).

torch's FSDP tests bind ``fully_shard`` and ``FSDPModule`` when their module is imported,
and the multi-process ones import it again in each spawned rank, so shardwrap's names must
be in torch's modules before any test module runs, in every process: Python imports
``sitecustomize`` at startup, before anything else. With ``SW_TORCH_SUITE_INSTALL=1``
(the driver sets it for the shardwrap column) this calls ``shardwrap.install()`` and binds
the same two names at the private spellings some test files import them from; without it
(the torch column) nothing changes. ``SW_TORCH_SUITE_CPU_RANKS=1`` (``--cpu-ranks``, both
columns) lets torch's multi-process tests start their ranks without accelerators
(``cpu_ranks.py``); ``SW_TORCH_SUITE_LIFT_GATES=1`` (``--lift-gpu-gates``, both columns) runs
tests gated on accelerators on a machine that has none and ``SW_TORCH_SUITE_FSDP1_CPU=1``
(``--fsdp1-cpu-device-id``, both columns) lets torch's FSDP1 built without ``device_id`` run
on CPU (both in ``gates.py``).
"""

import os

# The gates first: the FSDP1 shim must find torch's class under its name, before install()
# rebinds the name.
if os.environ.get("SW_TORCH_SUITE_LIFT_GATES") == "1":
    from benchmarks.torch_suite.gates import lift_device_gates

    lift_device_gates()
if os.environ.get("SW_TORCH_SUITE_FSDP1_CPU") == "1":
    from benchmarks.torch_suite.gates import default_fsdp1_cpu_device_id

    default_fsdp1_cpu_device_id()
if os.environ.get("SW_TORCH_SUITE_INSTALL") == "1":
    from benchmarks.torch_suite.swap import swap_names

    swap_names()
if os.environ.get("SW_TORCH_SUITE_CPU_RANKS") == "1":
    from benchmarks.torch_suite.cpu_ranks import allow_cpu_ranks

    allow_cpu_ranks()
