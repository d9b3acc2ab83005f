"""benchmarks/torch_suite's --fsdp1-cpu-device-id: torch's FSDP1 built without device_id
builds on CPU, in the torch column, and shardwrap's class is left as it is.

A stand-in for one of torch's FSDP1 test files (written here, not torch's) builds
``FullyShardedDataParallel(module)`` without ``device_id``, over an object that answers only
``rank()`` and ``size()``, as torch's auto-wrap tests' ``DummyProcessGroup`` does. Control:
without the option the torch column raises torch's "FSDP needs a non-CPU accelerator
device" where there is no accelerator. (``--lift-gpu-gates`` patches
``torch.testing._internal``, which needs ``expecttest``, not in the test extra.)
"""

from __future__ import annotations

import torch

from benchmarks.torch_suite.run import run_one

STAND_IN = """
import unittest

import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class OfflineGroup:
    def rank(self):
        return 0

    def size(self):
        return 1


class TestCpuDeviceId(unittest.TestCase):
    def test_fsdp1_without_device_id(self):
        model = FSDP(nn.Linear(2, 2), process_group=OfflineGroup())
        self.assertIsInstance(model, FSDP)
"""
KEY = "test_cpu_device_id_stand_in.TestCpuDeviceId.test_fsdp1_without_device_id"


def test_torchs_fsdp1_without_device_id_builds_on_cpu_with_the_option(tmp_path, monkeypatch):
    path = tmp_path / "test_cpu_device_id_stand_in.py"
    path.write_text(STAND_IN)
    monkeypatch.setenv("SW_TORCH_SUITE_FSDP1_CPU", "1")
    theirs = run_one(path, "torch", 300, [], tmp_path)
    ours = run_one(path, "shardwrap", 300, [], tmp_path)
    assert theirs[KEY]["status"] == "pass", theirs
    assert ours[KEY]["status"] == "pass", ours
    monkeypatch.setenv("SW_TORCH_SUITE_FSDP1_CPU", "0")
    control = run_one(path, "torch", 300, [], tmp_path)
    if torch.accelerator.is_available():
        assert control[KEY]["status"] == "pass", control
    else:
        assert control[KEY]["status"] == "error", control
        assert "non-CPU accelerator" in control[KEY]["detail"], control
