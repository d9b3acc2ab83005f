"""Runs examples/train_gpt.py as torchrun's worker, with one fault put in, once: the first
time rank ``RANK`` reaches step ``STEP`` it writes ``MARKER`` (the fault's unix time; the
restarted workers see it and run clean) and then, by ``MODE``:

* ``kill`` (the default): SIGKILLs itself at the optimizer step (after its backward, before
  its update);
* ``kill-agent``: the same, after SIGKILLing its parent, the torchrun agent, first: the
  whole node is gone for good;
* ``hang``: sleeps for ever as the step's forward begins, before any collective of it.

    python elastic_fault_worker.py MARKER RANK STEP [MODE] -- <train_gpt.py's arguments>
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
MODES = ("kill", "kill-agent", "hang")


def main() -> None:
    ours = sys.argv[1 : sys.argv.index("--")]
    marker, fault_rank, fault_step = Path(ours[0]), int(ours[1]), int(ours[2])
    mode = ours[3] if len(ours) > 3 else "kill"
    if mode not in MODES:
        raise SystemExit(f"MODE: expected one of {MODES}, got {mode!r}")
    steps_begun = 0  # optimizer steps begun in this process (the first life starts at 1)

    def due() -> bool:
        return dist.get_rank() == fault_rank and not marker.exists()

    def at_optimizer_step(_optimizer, _args, _kwargs) -> None:
        nonlocal steps_begun
        steps_begun += 1
        if mode != "hang" and steps_begun == fault_step and due():
            marker.write_text(f"{time.time():.3f}\n")
            if mode == "kill-agent":
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    def at_forward(_module, _inputs) -> None:
        if mode == "hang" and steps_begun == fault_step - 1 and due():
            marker.write_text(f"{time.time():.3f}\n")
            while True:
                time.sleep(3600)

    register_optimizer_step_pre_hook(at_optimizer_step)  # every optimizer: the example has one
    register_module_forward_pre_hook(at_forward)
    sys.argv = [str(EXAMPLE), *sys.argv[sys.argv.index("--") + 1 :]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
