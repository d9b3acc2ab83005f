"""Shared fixtures."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch.distributed as dist

# DeepSpeed (a test extra, the reference in the DeepSpeed parity tests) must not look for an
# accelerator or compile ops on this CPU machine; spawned ranks inherit the setting.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process, for single-process tests."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'rdv')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()
