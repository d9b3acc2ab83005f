"""Consolidation to Hugging Face layout, the CLI, and loading that layout back sharded."""

from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import load_file

from shardwrap.__main__ import main
from shardwrap.ckpt.consolidate import HF_INDEX_FILE, HF_SINGLE_FILE, consolidate
from tests import models
from tests.dist.ckpt_workers import assemble, phase, pretrained_outcomes
from tests.dist.harness import run_ranks


def _load_folder(folder: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def test_consolidate_inspect_and_load_pretrained(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    snapshot = assemble(run_ranks(phase, 3, "SHARD_GRAD_OP", None, ckpt, None, 0))
    params = {k: torch.from_numpy(v) for k, v in snapshot["params"].items()}
    expected_keys = sorted(models.TinyGPT().state_dict())

    single = str(tmp_path / "hf")
    assert consolidate(ckpt, single) == [HF_SINGLE_FILE]
    loaded = load_file(os.path.join(single, HF_SINGLE_FILE))
    assert sorted(loaded) == expected_keys
    for name, value in params.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(loaded["head.weight"], params["tok.weight"], rtol=0, atol=0)
    plain = models.TinyGPT()
    plain.load_state_dict(loaded)  # strict: exactly the unwrapped model's keys

    sharded_hf = str(tmp_path / "hf_bf16")
    argv = ["consolidate", ckpt, sharded_hf, "--dtype", "bf16", "--max-shard-size", "20KB"]
    assert main(argv) == 0
    files = sorted(os.listdir(sharded_hf))
    assert HF_INDEX_FILE in files and "model-00001-of-" in files[0], files
    assert len(files) > 3 and all(os.path.getsize(os.path.join(sharded_hf, f)) for f in files)
    loaded = _load_folder(sharded_hf)
    assert sorted(loaded) == expected_keys
    for name, value in params.items():
        torch.testing.assert_close(loaded[name], value.to(torch.bfloat16), rtol=0, atol=0)

    capsys.readouterr()
    assert main(["inspect", ckpt, "--tensors"]) == 0
    report = capsys.readouterr().out
    assert "3 rank(s), strategy SHARD_GRAD_OP" in report and "checksum ok" in report, report
    assert "head.weight: float32 [64, 32]" in report and "(tied to tok.weight)" in report
    broken = str(tmp_path / "broken")
    shutil.copytree(ckpt, broken)
    victim = sorted(n for n in os.listdir(broken) if n.endswith(".safetensors"))[0]
    with open(os.path.join(broken, victim), "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        handle.write(b"\xff")
    assert main(["inspect", broken]) == 1
    assert f"file {victim}" in capsys.readouterr().out
    assert main(["consolidate", str(tmp_path / "absent"), str(tmp_path / "x")]) == 2

    cases = [
        (single, "float32"),
        (sharded_hf, "bfloat16"),
        (os.path.join(single, HF_SINGLE_FILE), "float32"),
    ]
    assert run_ranks(pretrained_outcomes, 2, cases, snapshot) == [True, True]
