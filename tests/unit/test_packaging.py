"""Packaging: ``import shardwrap`` pulls in no test extra, and torch is a range, not a pin."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_EXTRAS = (
    "pytest", "hypothesis", "transformers", "accelerate", "deepspeed", "matplotlib",
    "torchtitan", "spmd_types", "tyro", "triton",
)  # fmt: skip


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


# What shardwrap imports of torch: torch 2.14+ imports spmd_types itself from these when
# it is installed (a test extra here), which is torch's import, not shardwrap's.
TORCH_MODULES = "torch, torch.distributed, torch.distributed.fsdp, torch.distributed.checkpoint"


def test_import_shardwrap_imports_no_test_extra():
    baseline = _modules_after("import torch, torch.distributed")
    by_torch = _modules_after(f"import {TORCH_MODULES}")
    loaded = _modules_after("import shardwrap")
    roots = {name.split(".")[0] for name in loaded - by_torch}
    assert not roots & set(TEST_EXTRAS), roots & set(TEST_EXTRAS)
    # numpy only if torch itself loads it (torch imports numpy when it is installed).
    assert "numpy" not in {name.split(".")[0] for name in loaded - baseline}


def test_numpy_is_a_runtime_dependency_where_shardwrap_uses_it():
    # torch does not require numpy, but Tensor.numpy() raises without it: a plain
    # `pip install shardwrap` must bring it (make demo installs nothing else).
    users = []
    for folder, _, names in os.walk(os.path.join(ROOT, "shardwrap")):
        for name in (n for n in names if n.endswith(".py")):
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                text = handle.read()
            if ".numpy()" in text or "import numpy" in text:
                users.append(name)
    runtime = {Requirement(d).name for d in _project()["dependencies"]}
    assert not users or "numpy" in runtime, users


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["project"]


def _tested_torch() -> list[str]:
    """The torch releases the Makefile builds a venv for (its TESTED_TORCH line)."""
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as handle:
        line = next(x for x in handle if x.startswith("TESTED_TORCH :="))
    return line.split(":=", 1)[1].split()


def _range_mismatches(requirement: str, tested: list[str]) -> list[str]:
    """What is wrong with ``requirement`` as the torch range for the ``tested`` releases:
    a tested one it refuses, or the minor line just outside the tested ones it admits."""
    specifier = Requirement(requirement).specifier
    minors = sorted({Version(v).release[:2] for v in tested})
    (low_major, low_minor), (high_major, high_minor) = minors[0], minors[-1]
    below = f"{low_major}.{low_minor - 1}.99" if low_minor else f"{low_major - 1}.99.99"
    above = f"{high_major}.{high_minor + 1}.0"
    wrong = [f"refuses tested {v}" for v in tested if not specifier.contains(v)]
    wrong += [f"admits untested {v}" for v in (below, above) if specifier.contains(v)]
    return wrong


def test_torch_range_admits_exactly_the_tested_releases():
    project = _project()
    torch_requirement = next(d for d in project["dependencies"] if d.startswith("torch"))
    tested = _tested_torch()
    assert tested[0] == "2.13.0"  # the default venv's torch, the floor's reason (pyproject)
    assert _range_mismatches(torch_requirement, tested) == []


def test_range_check_catches_a_range_that_misses_a_tested_release():
    # The range shardwrap declared before 2.15 was tested: the check must refuse it, and one
    # that runs past the newest tested minor line.
    tested = ["2.13.0", "2.14.1", "2.15.0"]
    assert _range_mismatches("torch>=2.13,<2.15", tested) == ["refuses tested 2.15.0"]
    assert _range_mismatches("torch>=2.13", tested) == ["admits untested 2.16.0"]
    assert _range_mismatches("torch>=2.12,<2.16", tested) == ["admits untested 2.12.99"]


def test_each_tested_torch_has_its_constraints_and_the_extras_pin_the_peers():
    test = _project()["optional-dependencies"]["test"]
    assert "accelerate==1.15.0" in test and "deepspeed==0.19.8" in test
    assert "lightning==2.6.6" in test
    files = sorted(os.listdir(os.path.join(ROOT, "constraints")))
    tested = _tested_torch()
    assert files == sorted(f"torch-{v}.txt" for v in tested)
    for version in tested:
        with open(os.path.join(ROOT, "constraints", f"torch-{version}.txt")) as handle:
            pins = [line for line in handle.read().split() if not line.startswith("#")]
        assert f"torch=={version}" in pins
        assert any(p.startswith("transformers==") for p in pins), version
        assert any(p.startswith("triton==") for p in pins), version  # torchtitan imports it


def test_torchtitan_is_pinned_and_installed_without_its_trainer_requirements():
    """The Makefile installs one torchtitan release with --no-deps (pyproject's test extra
    says why); what its model and parallelize code import is in the test extra."""
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as handle:
        makefile = handle.read()
    assert "TORCHTITAN := torchtitan==0.3.0\n" in makefile
    assert "$(PIP) --no-deps $(TORCHTITAN)" in makefile
    test = _project()["optional-dependencies"]["test"]
    assert {"spmd_types==0.2.3", "tyro==1.0.17", "triton; sys_platform == 'linux'"} <= set(test)


def test_installing_shardwrap_here_changes_no_torch():
    """pip's own resolution, against the torch this venv holds: installing shardwrap adds
    shardwrap and nothing else (no other torch, no missing requirement)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    # No configuration file either: a machine's pip cap on torch is not a user's.
    env["PIP_CONFIG_FILE"] = os.devnull
    report = os.path.join(ROOT, ".pytest_cache", f"pip-report-{os.getpid()}.json")
    os.makedirs(os.path.dirname(report), exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "-q"]
    command += ["--no-build-isolation", "--report", report, ROOT]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with open(report, encoding="utf-8") as handle:
        installs = [item["metadata"]["name"] for item in json.load(handle)["install"]]
    os.remove(report)
    assert installs == ["shardwrap"], installs
