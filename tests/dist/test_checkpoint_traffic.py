"""What a checkpoint save and load move between real ranks: no rank receives another's
piece list except rank 0 (a gather), and everything else is fixed-size all-reduces."""

from __future__ import annotations

import shardwrap
from shardwrap import load_checkpoint, save_checkpoint
from tests.dist import parity
from tests.dist.harness import run_ranks


def _traffic_worker(rank: int, world_size: int, folder: str) -> dict:
    model = shardwrap.ShardedModule(
        parity.build_model("gpt"), auto_wrap_policy=parity.wrap_policy("gpt")
    )
    optim = parity.make_optimizer(model, "adamw")
    parity.loss_for("gpt", model, parity.batch_for("gpt", rank), 0).backward()
    optim.step()
    ledger = model.comm_ledger
    ledger.reset()
    save_checkpoint(folder, model, optim, extra={"step": 1})
    saved = [(r.kind, r.purpose, r.num_bytes) for r in ledger.records]
    ledger.reset()
    assert load_checkpoint(folder, model, optim) == {"step": 1}
    loaded = [(r.kind, r.purpose, r.num_bytes) for r in ledger.records]
    return {"save": saved, "load": loaded}


def test_only_rank_0_receives_the_piece_records(tmp_path) -> None:
    results = run_ranks(_traffic_worker, 3, str(tmp_path / "ckpt"))
    for rank, result in enumerate(results):
        kinds = [kind for kind, _, _ in result["save"]]
        assert "all_gather_object" not in kinds, (rank, result)
        assert kinds.count("gather_object") == 1
        # rank 0's save id with the failure count, the gather's largest size, the outcome
        reduced = sorted(b for kind, _, b in result["save"] if kind == "all_reduce")
        assert reduced == [4, 8, 16], (rank, result)
        sent = next(b for kind, _, b in result["save"] if kind == "gather_object")
        assert sent > 0, (rank, result)  # its own report, to rank 0
        # the union of the ranks' names (pipeline stages) as JSON in tensors, then the
        # outcome of the checks and of the load: fixed sizes besides the names themselves
        kinds = [(kind, purpose) for kind, purpose, _ in result["load"]]
        assert not [kind for kind, _ in kinds if kind.endswith("_object")], (rank, result)
        assert kinds == [
            ("all_reduce", "checkpoint_names"),
            ("gather", "checkpoint_names"),
            ("all_reduce", "checkpoint_names"),
            ("broadcast", "checkpoint_names"),
            ("all_reduce", "checkpoint"),
            ("all_reduce", "checkpoint"),
        ], (rank, result)
