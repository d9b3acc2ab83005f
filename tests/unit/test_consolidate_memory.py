"""Consolidation streams: its peak memory grows by a few tensors, not by the model."""

from __future__ import annotations

import os
import subprocess
import sys

from torch import nn

from shardwrap import ShardedModule
from shardwrap.checkpoint import save_checkpoint

NUM_LAYERS = 12
LAYER_BYTES = 2048 * 1024 * 4  # one fp32 Linear(1024, 2048) weight: 8 MiB
# Measured 20 MiB (about 2.5 tensors): a tensor read out of its file, the mapped
# pages while it is read, and allocator slack. A loader that held the model would grow by
# 96 MiB or more; the limit sits at half of that.
PEAK_GROWTH_LIMIT = 6 * LAYER_BYTES

# Linux: writing 5 to clear_refs resets the peak (VmHWM) to the current resident size.
_MEASURE = """
import sys
from shardwrap.ckpt.consolidate import consolidate
def kib(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field))
    return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")
before = kib("VmRSS:")
consolidate(sys.argv[1], sys.argv[2])
print((kib("VmHWM:") - before) * 1024)
"""


def test_consolidation_peak_memory_is_about_one_tensor(one_rank, tmp_path):
    model = nn.Sequential(*(nn.Linear(1024, 2048, bias=False) for _ in range(NUM_LAYERS)))
    save_checkpoint(tmp_path / "ckpt", ShardedModule(model))
    del model
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "ckpt"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    growth = int(result.stdout.split()[-1])
    model_bytes = NUM_LAYERS * LAYER_BYTES
    assert os.path.getsize(tmp_path / "out" / "model.safetensors") > model_bytes
    assert growth < PEAK_GROWTH_LIMIT, f"peak grew {growth / 2**20:.0f} MiB; model is 96 MiB"
    print(f"consolidating {model_bytes / 2**20:.0f} MiB: peak RSS grew {growth / 2**20:.1f} MiB")
