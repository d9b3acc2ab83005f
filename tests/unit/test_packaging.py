"""Packaging: ``import shardwrap`` pulls in no test extra, and torch is a range, not a pin."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_EXTRAS = ("pytest", "hypothesis", "transformers", "accelerate", "deepspeed", "matplotlib")


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_shardwrap_imports_no_test_extra():
    baseline = _modules_after("import torch, torch.distributed")
    loaded = _modules_after("import shardwrap")
    roots = {name.split(".")[0] for name in loaded}
    assert not roots & set(TEST_EXTRAS), roots & set(TEST_EXTRAS)
    # numpy only if torch itself loads it (torch imports numpy when it is installed).
    assert "numpy" not in {name.split(".")[0] for name in loaded - baseline}


def test_torch_is_a_range_and_the_extras_pin_the_peers():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)["project"]
    torch_requirement = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert "==" not in torch_requirement and ">=" in torch_requirement and "<" in torch_requirement
    test = project["optional-dependencies"]["test"]
    assert "accelerate==1.15.0" in test and "deepspeed==0.19.8" in test
    with open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8") as handle:
        assert "torch==2.13.0" in handle.read().split()
