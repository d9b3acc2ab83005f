"""DeepSpeed's top-level names on shardwrap: zero.Init, zero.GatheredParameters, comm, args."""

from __future__ import annotations

import argparse

import torch

import shardwrap as deepspeed
from tests.dist.harness import run_ranks

CONFIG = {
    "train_batch_size": 4,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "zero_optimization": {"stage": 3},
}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 5)
        self.fc2 = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    with deepspeed.zero.Init(remote_device="cpu", config_dict_or_path=CONFIG):
        model = Net()  # built as usual (Init warns so: tests/unit/test_zero_init_args.py)
    full = model.fc1.weight.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    out: dict = {"sharded_numel": model.fc1.weight.numel()}
    with deepspeed.zero.GatheredParameters(model.fc1.weight):
        out["gathered_equal"] = torch.equal(model.fc1.weight, full)
        model.fc1.weight.data.fill_(float(rank) + 5.0)  # dropped: no modifier_rank
    with deepspeed.zero.GatheredParameters([model.fc1.weight, model.fc1.bias], modifier_rank=0):
        model.fc1.weight.data.fill_(float(rank) + 1.0)  # rank 0's value wins
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["after"] = model.fc1.weight.tolist()  # plain lists through the queue
    x = torch.ones(2, 6)
    out["forward"] = engine(x).tolist()
    out["comm"] = (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size())
    out["local_rank"] = deepspeed.comm.get_local_rank()
    # initialize also takes a DeepSpeedConfig object (DeepSpeed takes only dicts and paths).
    other, *_ = deepspeed.initialize(model=Net(), config=deepspeed.DeepSpeedConfig(CONFIG))
    out["other_stage"] = other.zero_optimization_stage()
    return out


def test_zero_init_gathered_parameters_and_comm():
    results = run_ranks(_worker, 2)
    for rank, out in enumerate(results):
        assert out["sharded_numel"] < 30  # a shard, outside the block
        assert out["gathered_equal"]
        assert out["after"] == torch.ones(5, 6).tolist()  # rank 0's edit, on every rank
        assert out["comm"] == (rank, 2)
        assert out["other_stage"] == 3
    assert results[0]["forward"] == results[1]["forward"]


def test_add_config_arguments_and_config_class(tmp_path):
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json"
    assert parser.parse_args([]).deepspeed is False
    config = deepspeed.DeepSpeedConfig({**CONFIG, "gradient_accumulation_steps": 2})
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (4, 2)
    assert config.zero_optimization_stage == 3 and config.optimizer_name == "sgd"
    assert deepspeed.__version__ and deepspeed.version == deepspeed.__version__
