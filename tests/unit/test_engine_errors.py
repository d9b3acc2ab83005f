"""``shardwrap.initialize`` refuses what it cannot do, with errors naming the problem."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

import shardwrap
from tests import models

SGD = {"type": "SGD", "params": {"lr": 0.1}}


def config(**extra) -> dict:
    return {"train_batch_size": 4, "optimizer": SGD, **extra}


def test_process_group_from_the_launchers_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="environment lacks WORLD_SIZE, MASTER_ADDR"):
        shardwrap.initialize(model=models.MLP(), config=config())
    with pytest.raises(RuntimeError, match="dist_init_required=False"):
        shardwrap.initialize(model=models.MLP(), config=config(), dist_init_required=False)
    # One process without a launcher: a one-rank gloo group, as torchrun --nproc-per-node 1.
    monkeypatch.delenv("RANK")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
    try:
        engine, *_ = shardwrap.initialize(model=models.MLP(), config=config())
        assert (engine.world_size, engine.global_rank, engine.local_rank) == (1, 0, 0)
        assert dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                }
            },
            "'nvme' keeps optimizer state on disk for Adam and AdamW only, got SGD",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
                    "offload_optimizer": {"device": "cpu"},
                }
            },
            r"offload_param \{device: nvme\} with offload_optimizer \{device: cpu\} is not",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/var/tmp"},
                }
            },
            "offload_param.nvme_path='/tmp', offload_optimizer.nvme_path='/var/tmp' differ",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
                }
            },
            "'nvme' keeps optimizer state on disk for Adam and AdamW only, got SGD",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent"},
                }
            },
            "DiskOffload: path '/nonexistent' does not exist",
        ),
        ({"train_batch_size": 5, "gradient_accumulation_steps": 2}, r"\(5\).*\(2\).*\(1\)"),
    ],
)
def test_unsupported_or_inconsistent_configs(one_rank, extra, message):
    with pytest.raises(ValueError, match=message):
        shardwrap.initialize(model=models.MLP(), config=config(**extra))


def test_optimizer_given_twice(one_rank):
    model = models.MLP()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizer: given both"):
        shardwrap.initialize(model=model, optimizer=client, config=config())


def test_client_optimizer_that_already_stepped(one_rank):
    model = models.MLP()
    client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    models.mlp_loss(model, models.mlp_batch(0)).backward()
    client.step()
    with pytest.raises(ValueError, match="already stepped"):
        shardwrap.initialize(model=model, optimizer=client, config={"train_batch_size": 4})


def test_optimizer_that_is_not_elementwise(one_rank):
    stage2 = {"train_batch_size": 4, "zero_optimization": {"stage": 2}}
    model = models.MLP()
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="LBFGS is not known to update element by element"):
        shardwrap.initialize(model=model, optimizer=lbfgs, config=stage2)
    allowed = {**stage2, "zero_allow_untested_optimizer": True}
    model = models.MLP()
    lbfgs = torch.optim.LBFGS(model.parameters())
    _, optim, _, _ = shardwrap.initialize(model=model, optimizer=lbfgs, config=allowed)
    assert optim is lbfgs


def test_foreign_parameter(one_rank):
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="shape \\(3,\\) is not in the model"):
        shardwrap.initialize(model=models.MLP(), model_parameters=[stranger], config=config())


def test_batch_accessors_and_config_from_args(one_rank, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_batch_size": 6, "gradient_accumulation_steps": 3, "optimizer": {"type": "SGD"}}'
    )
    args = type("Args", (), {"deepspeed_config": str(path)})()
    engine, _, loader, scheduler = shardwrap.initialize(args=args, model=models.MLP())
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()) == (6, 2)
    assert engine.gradient_accumulation_steps() == 3 and loader is None and scheduler is None


def test_a_shard_view_is_never_taken_for_a_freed_parameter():
    """``model.parameters()`` read after wrapping yields shard views; one may reuse the id of
    an original parameter that wrapping freed, and must still map to itself."""
    from shardwrap.deepspeed.engine_parts import _remap

    view, other = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    stale_names = {id(view): "other"}  # as if `view` reused the id of the freed original
    assert _remap(view, stale_names, {"view": view, "other": other}) is view
