"""The one-device FSDP2 comparison script runs end to end on CPU and trains identically.

The training run is a true subprocess (the script as a user starts it); the argument check
calls the script's ``parse_args`` in this process (an interpreter start is seconds of CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, *extra: str) -> dict:
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--device", "cpu"]
    cmd += ["--size", "1m", "--steps", "2", "--warmup", "1", "--batch", "2", "--json", str(out)]
    done = subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tokens/s shardwrap / fsdp2" in done.stdout
    return json.loads(out.read_text())


def test_fp32_losses_equal_unsharded_and_fsdp2_bit_for_bit(tmp_path) -> None:
    results = _run(tmp_path, "--dtype", "float32", "--impls", "shardwrap,fsdp2,plain")
    assert set(results) == {"shardwrap", "fsdp2", "plain"}
    assert len(results["plain"]["losses"]) == 3  # warm-up + timed steps
    assert len(set(results["plain"]["losses"])) == 3  # the weights changed between steps
    assert results["shardwrap"]["losses"] == results["plain"]["losses"]
    assert results["fsdp2"]["losses"] == results["plain"]["losses"]
    assert all(r["tokens_per_s"] > 0 and r["peak_bytes"] is None for r in results.values())


def test_unknown_implementation_is_named(capsys) -> None:
    from benchmarks import bench_gpu

    with pytest.raises(SystemExit) as exit_info:
        bench_gpu.parse_args(["--impls", "ddp"])
    assert exit_info.value.code != 0
    assert "unknown implementation 'ddp'" in capsys.readouterr().err
