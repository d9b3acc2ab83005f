"""A wrapped model lets go of its process groups before the interpreter finalizes.

See [Note: process groups at interpreter exit] in ``shardwrap/base/at_exit.py``. Each rank
checks, in an exit handler that runs after shardwrap's, whether the world group's Python
object is still alive: if it were, finalization would be the one to destroy it.
"""

from __future__ import annotations

import atexit
import json
import os
import weakref

import pytest
import torch
import torch.distributed as dist

import shardwrap
from shardwrap.assemble.root import root_of
from shardwrap.base import at_exit
from tests import models
from tests.dist.harness import run_ranks
from tests.dist.parity import build_model, wrap_policy

_KEPT: list = []  # a model kept reachable until exit, as a module global would be


def _report_at_exit(path: str, group_ref: weakref.ref, comm_ref: weakref.ref) -> None:
    comm = comm_ref()
    error = ""
    if comm is not None:
        try:
            comm.all_reduce(torch.ones(1), purpose="after_exit")
        except RuntimeError as exc:
            error = str(exc)
    with open(path, "w") as f:
        json.dump({"group_alive": group_ref() is not None, "error": error}, f)


def _worker(rank: int, world_size: int, out_dir: str, keep_model: bool) -> None:
    group_ref = weakref.ref(dist.group.WORLD)
    path = os.path.join(out_dir, f"rank{rank}.json")
    model = shardwrap.ShardedModule(
        build_model("mlp"), sharding_strategy="NO_SHARD", auto_wrap_policy=wrap_policy("mlp")
    )
    models.mlp_loss(model, models.mlp_batch(rank)).backward()
    comm_ref = weakref.ref(root_of(model).runtime.world_comm)
    # Handlers run last registered first: shardwrap's (registered with the model's
    # communicators) goes back on top, so the report sees what finalization would.
    atexit.unregister(at_exit.release_all)
    atexit.register(_report_at_exit, path, group_ref, comm_ref)
    atexit.register(at_exit.release_all)
    if keep_model:
        _KEPT.append(model)
    # The harness then destroys the process group, and the model (in reference cycles)
    # is garbage that only a collection would free.


@pytest.mark.spawned_ranks  # checks what happens at interpreter exit (a forked rank skips it)
@pytest.mark.parametrize("keep_model", [False, True], ids=["garbage", "reachable"])
def test_process_groups_die_before_finalization(tmp_path, keep_model: bool) -> None:
    run_ranks(_worker, 2, str(tmp_path), keep_model)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["group_alive"] is False
        if keep_model:
            assert "released at interpreter exit" in report["error"]
