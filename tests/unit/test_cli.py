"""The ``shardwrap`` console script as a shell user meets it: help, exit codes, messages.

Runs the installed script (and ``python -m shardwrap``) in subprocesses, with this checkout
first on ``PYTHONPATH``, where the process is the subject (help from the script, a
consolidation from the shell, a closed pipe); messages and exit codes of bad arguments
through ``main()`` in this process, whose return value the script exits with (an
interpreter start is seconds of CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import shardwrap
from shardwrap.__main__ import main
from tests import models

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "shardwrap"


def shardwrap_cli(*args: str, module: bool = False, **kwargs) -> subprocess.CompletedProcess:
    assert SCRIPT.exists(), f"{SCRIPT} is missing: install the package (pip install -e .)"
    command = [sys.executable, "-m", "shardwrap"] if module else [str(SCRIPT)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, env=env, timeout=120, **kwargs
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A one-rank TinyGPT checkpoint, saved in this process."""
    import torch.distributed as dist

    folder = tmp_path_factory.mktemp("cli")
    dist.init_process_group(
        "gloo", init_method=f"file://{folder / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        model = shardwrap.ShardedModule(models.TinyGPT())
        shardwrap.save_checkpoint(folder / "ckpt", model)
        expected = model.state_dict()
    finally:
        dist.destroy_process_group()
    torch.save(expected, folder / "expected.pt")
    return folder / "ckpt"


def test_help_of_the_script_and_of_every_subcommand(capsys):
    result = shardwrap_cli("--help")  # the console script itself
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: shardwrap"), result.stdout
    assert "{consolidate,inspect" in result.stdout and "exit codes: 0 success" in result.stdout
    for command, option in (("consolidate", "--max-shard-size"), ("inspect", "--no-verify")):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: shardwrap {command}") and option in text, text
        assert "exit codes: 0 success" in text, text
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"shardwrap {shardwrap.__version__}"


def test_errors_name_the_problem_with_exit_code_2(tmp_path, checkpoint, capsys):
    # In this process: the script's exit code is main()'s (the shell tests below show it).
    assert main(["consolidate", str(tmp_path / "absent"), str(tmp_path / "out")]) == 2
    assert (
        capsys.readouterr().err
        == f"shardwrap consolidate: error: checkpoint {tmp_path / 'absent'}: no such folder\n"
    )
    cases = [
        (["inspect", str(tmp_path)], f"checkpoint {tmp_path}: no index.json"),
        (["consolidate", str(checkpoint), str(tmp_path / "o"), "--dtype", "int7"], "allowed: bf16"),
        (["consolidate", str(checkpoint), str(tmp_path / "o"), "--max-shard-size", "lots"], "5GB"),
        (["consolidate", str(checkpoint), str(checkpoint)], "out: must differ from the checkpoint"),
    ]
    for args, message in cases:
        assert main(args) == 2, args
        assert message in capsys.readouterr().err, args
    for args, message in (([], "arguments are required: command"), (["estimat"], "invalid choice")):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, args


def test_consolidate_and_inspect_from_the_shell(tmp_path, checkpoint, capsys):
    out = tmp_path / "hf"
    result = shardwrap_cli("consolidate", str(checkpoint), str(out), module=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote model.safetensors to {out}"
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    expected = torch.load(checkpoint.parent / "expected.pt")
    loaded = safetensors.torch.load_file(out / "model.safetensors")
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    assert main(["inspect", str(checkpoint)]) == 0
    assert "checksum ok" in capsys.readouterr().out


def test_a_closed_pipe_ends_quietly(checkpoint):
    assert SCRIPT.exists()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # The reader goes away before the script prints anything (it imports torch first).
    with subprocess.Popen(
        [str(SCRIPT), "inspect", "--tensors", str(checkpoint)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    ) as process:
        process.stdout.close()
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=120) == 141, stderr
    assert stderr == "", stderr
