"""The one-device FSDP2 comparison script runs end to end on CPU and trains identically."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_unknown_implementation_is_named(tmp_path) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--impls", "ddp"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "unknown implementation 'ddp'" in done.stderr
