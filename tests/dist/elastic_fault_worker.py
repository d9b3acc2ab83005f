"""Runs examples/train_gpt.py as torchrun's worker, with one fault put in: the first time
any worker reaches the optimizer step of step ``KILL_STEP`` on rank ``KILL_RANK`` (after
its backward, before its update), it SIGKILLs itself, leaving ``MARKER`` behind so the
restarted workers run clean.

    python elastic_fault_worker.py MARKER KILL_RANK KILL_STEP -- <train_gpt.py's arguments>
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_pre_hook
import torch.distributed as dist

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def main() -> None:
    marker, kill_rank, kill_step = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    steps = 0

    def maybe_die(_optimizer, _args, _kwargs) -> None:
        nonlocal steps
        steps += 1
        if steps == kill_step and dist.get_rank() == kill_rank and not marker.exists():
            marker.write_text(f"killed rank {kill_rank} at step {kill_step}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_pre_hook(maybe_die)  # every optimizer: the example makes one
    sys.argv = [str(EXAMPLE), *sys.argv[sys.argv.index("--") + 1 :]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
