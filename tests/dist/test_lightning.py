"""Lightning's ``FSDPStrategy`` runs shardwrap after ``shardwrap.install()``, unchanged.

Lightning's ``Trainer`` on 2 CPU ranks: fit, ``trainer.save_checkpoint`` (Lightning's full
state dict and FSDP1's optimizer-state call), ``fit(ckpt_path=...)`` in other processes;
losses equal Lightning's own DDP run, saved and resumed the same way, bit for bit (fp32).
Lightning's loop, not the model, decides which batches a mid-epoch resume sees, so the
resumed runs are compared with each other rather than with an uninterrupted run.
Lightning refuses its FSDP strategy on a CPU accelerator; the worker passes it through a
trivial subclass, as the accelerate tests pick the FSDP path by hand.
"""

from __future__ import annotations

import lightning  # noqa: F401 (a declared test dependency: a broken install fails, never skips)

from tests.dist import lightning_worker as worker
from tests.dist.harness import run_ranks


def test_lightning_fsdp_trains_saves_and_resumes(tmp_path) -> None:
    first = run_ranks(worker.first_processes, 2, str(tmp_path))[0]
    resumed = run_ranks(worker.resumed_processes, 2, str(tmp_path))[0]
    assert first["wrapper"] == "ShardedModule"
    assert first["num_fsdp"] == 3  # the root and two blocks
    assert first["fsdp"] == first["ddp"]
    assert len(resumed["ddp"]) == 3
    assert resumed["fsdp"] == resumed["ddp"]
    assert resumed["ddp"][-1] < first["ddp"][0]
