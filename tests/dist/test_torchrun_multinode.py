"""Two torchrun launches on this machine act as two nodes of 2 ranks (world 4, loopback)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

TORCHRUN_TIMEOUT_S = 240  # four ranks importing torch on 2 loaded cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_hybrid_shard_matches_reference(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    port = _free_port()
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    common = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2",
        # torchrun's default static rendezvous: node 0 hosts the store on the endpoint and
        # --node-rank orders the ranks (c10d ignores --node-rank, and both "nodes" here
        # would race to host the store on the same loopback port).
        "--rdzv-endpoint", f"127.0.0.1:{port}",
    ]  # fmt: skip
    script = [str(repo / "tests" / "dist" / "torchrun_hybrid_worker.py"), str(out)]
    nodes = [
        subprocess.Popen(
            [*common, "--node-rank", str(r), *script],
            env=env,
            cwd=repo,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    logs = []
    try:
        for node in nodes:
            logs.append(node.communicate(timeout=TORCHRUN_TIMEOUT_S)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    codes = [node.returncode for node in nodes]
    # Whole logs: a rank's first error (not only torchrun's summary) tells what went wrong.
    assert codes == [0, 0], "\n".join(f"--- node {i} ---\n{log}" for i, log in enumerate(logs))
    result = json.loads(out.read_text())
    assert result["world_size"] == 4
    for losses in result["losses"].values():
        assert losses[-1] < losses[0]
