"""SHARDED_STATE_DICT + torch.distributed.checkpoint: save at 2 ranks, reshard on load.

TinyGPT has a tied embedding/head and a frozen positional table. The saving run writes
the whole state it held (our FULL_STATE_DICT path, checked elsewhere against an unwrapped
reference) and its state after two more steps next to the checkpoints.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as torch_dsd
from torch.distributed.tensor import DTensor

import shardwrap
from shardwrap import ShardedModule
from shardwrap.ckpt import dcp as sw_dcp
from shardwrap.options import StateDictType
from tests import models
from tests.dist import ckpt_workers, parity
from tests.dist.harness import run_ranks

EXACT = {"rtol": 0.0, "atol": 0.0}
SAVE_WORLD = 2


def _train(model, optim, rank, world_size, first_step, steps=2):
    for step in range(first_step, first_step + steps):
        loss = parity.loss_for("gpt", model, parity.batch_for("gpt", 1000 * step + rank), step)
        loss.backward()
        optim.step()
        optim.zero_grad()


def _full_state(sharded, optim) -> dict:
    return {
        "model": sharded.state_dict(),  # FULL_STATE_DICT (the default)
        "optim": ShardedModule.optim_state_dict(sharded, optim),
    }


def _assert_same(got, expected, path="") -> None:
    """Equal bit for bit (tensors), equal as values otherwise (tuples compare as lists)."""
    if isinstance(expected, dict):
        assert set(got) == set(expected), (path, sorted(got), sorted(expected))
        for key in expected:
            _assert_same(got[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected), path
        for index, (a, b) in enumerate(zip(got, expected, strict=True)):
            _assert_same(a, b, f"{path}[{index}]")
    elif isinstance(expected, torch.Tensor):
        got = got.full_tensor() if isinstance(got, DTensor) else got
        torch.testing.assert_close(got, expected, **EXACT, msg=path)
    else:
        assert got == expected, (path, got, expected)


def save_worker(rank, world_size, folder):
    torch.manual_seed(1234)
    sharded = ckpt_workers.wrap(models.TinyGPT(), world_size, "FULL_SHARD")
    optim = parity.make_optimizer(sharded, "adamw")
    _train(sharded, optim, rank, world_size, 0)
    expected = _full_state(sharded, optim)
    ledger = sharded.comm_ledger
    ledger.reset()
    with ShardedModule.state_dict_type(sharded, StateDictType.SHARDED_STATE_DICT):
        state = {
            "model": sharded.state_dict(),
            "optim": ShardedModule.optim_state_dict(sharded, optim),
        }
    assert ledger.count("all_gather", "sharded_state_dict") > 0  # through our Communicator
    weight = state["model"]["blocks.0.qkv.weight"]
    assert isinstance(weight, DTensor) and weight.shape == (96, 32), weight
    assert isinstance(state["optim"]["state"]["blocks.0.qkv.weight"]["exp_avg"], DTensor)
    step = state["optim"]["state"]["blocks.0.qkv.weight"]["step"]
    assert type(step) is torch.Tensor and step.dim() == 0
    assert state["model"]["head.weight"] is state["model"]["tok.weight"]  # tied
    _assert_same(state, expected)
    dcp.save(state, checkpoint_id=os.path.join(folder, "direct"))

    model_sd, optim_sd = sw_dcp.get_state_dict(sharded, optim)
    _assert_same({"model": model_sd, "optim": optim_sd}, expected)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(folder, "dsd"))
    full_model, _ = sw_dcp.get_state_dict(
        sharded, optim, options=torch_dsd.StateDictOptions(full_state_dict=True)
    )
    assert not any(isinstance(v, DTensor) for v in full_model.values())
    _assert_same(full_model, expected["model"])

    _train(sharded, optim, rank, world_size, 2)
    after = _full_state(sharded, optim)
    if rank == 0:
        torch.save({"before": expected, "after": after}, os.path.join(folder, "expected.pt"))
    return True


def _expected(folder) -> dict:
    return torch.load(os.path.join(folder, "expected.pt"), weights_only=False)


def _reference(expected) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The unwrapped model and optimizer in the saved state (no DCP involved)."""
    model = models.TinyGPT()
    model.load_state_dict(expected["model"])
    optim = parity.make_optimizer(model, "adamw")
    torch_dsd.set_optimizer_state_dict(model, optim, copy.deepcopy(expected["optim"]))
    return model, optim


def reshard_worker(rank, world_size, folder, strategy, which):
    expected = _expected(folder)
    torch.manual_seed(99)  # other weights until loaded
    sharded = ckpt_workers.wrap(models.TinyGPT(), world_size, strategy)
    optim = parity.make_optimizer(sharded, "adamw")
    if which == "direct":
        sw_dcp.init_optim_state(optim)  # so the state dict lists every state tensor
        with ShardedModule.state_dict_type(sharded, StateDictType.SHARDED_STATE_DICT):
            state = {
                "model": sharded.state_dict(),
                "optim": ShardedModule.optim_state_dict(sharded, optim),
            }
            dcp.load(state, checkpoint_id=os.path.join(folder, which))
            sharded.load_state_dict(state["model"])
            optim.load_state_dict(
                ShardedModule.optim_state_dict_to_load(sharded, optim, state["optim"])
            )
    else:
        # "torch": torch's own functions after shardwrap.install(), on the "dsd" checkpoint.
        api = sw_dcp
        if which == "torch":
            shardwrap.install()
            api = torch_dsd
        try:
            model_sd, optim_sd = api.get_state_dict(sharded, optim)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=os.path.join(folder, "dsd"))
            api.set_state_dict(
                sharded, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        finally:
            shardwrap.uninstall()
    _assert_same(_full_state(sharded, optim), expected["before"])
    # Continued training equals continued training of the saved state without DCP.
    reference, ref_optim = _reference(expected["before"])
    ckpt_workers.train_steps(sharded, optim, reference, ref_optim, world_size, rank, 2)
    return True


def unwrapped_worker(rank, world_size, folder, which):
    """One rank, the plain model: torch's own get/set_state_dict and a name-keyed optimizer."""
    expected = _expected(folder)
    torch.manual_seed(99)
    model = models.TinyGPT()
    optim = parity.make_optimizer(model, "adamw")
    model_sd, optim_sd = torch_dsd.get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(folder, which))
    torch_dsd.set_state_dict(
        model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    _assert_same(model.state_dict(), expected["before"]["model"])
    got = torch_dsd.get_optimizer_state_dict(model, optim)
    _assert_same(got["state"], expected["before"]["optim"]["state"])
    # The saving run continued on two ranks; here the same two batches, concatenated.
    for step in (2, 3):
        batches = [parity.batch_for("gpt", 1000 * step + r) for r in range(SAVE_WORLD)]
        parity.loss_for("gpt", model, parity.concat(batches), step).backward()
        optim.step()
        optim.zero_grad()
    # from the same state, two steps summed over the whole batch against two ranks' sums
    # (control: the loss doubled in these steps failed tok.weight by 5.7e-3 against 1.1e-3)
    tol = parity.reordered_tol("adamw", 2, parity.batch_terms("gpt", SAVE_WORLD))
    for key, value in expected["after"]["model"].items():
        got = model.state_dict()[key]
        torch.testing.assert_close(got, value, msg=lambda m, k=key: f"{k}: {m}", **tol)
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("dcp"))
    assert run_ranks(save_worker, SAVE_WORLD, folder) == [True] * SAVE_WORLD
    return folder


@pytest.mark.parametrize("which", ["direct", "dsd", "torch"])
def test_reshard_to_three_ranks_shard_grad_op(saved, which) -> None:
    assert run_ranks(reshard_worker, 3, saved, "SHARD_GRAD_OP", which) == [True] * 3


@pytest.mark.parametrize("which", ["direct", "dsd"])
def test_load_into_the_unwrapped_model(saved, which) -> None:
    assert run_ranks(unwrapped_worker, 1, saved, which) == [True]


def hybrid_worker(rank, world_size, folder):
    """HYBRID_SHARD (2 x 2): a 2-D mesh, Replicate() + Shard(0); save and load back."""
    torch.manual_seed(1234)
    sharded = ckpt_workers.wrap(models.TinyGPT(), world_size, "HYBRID_SHARD")
    optim = parity.make_optimizer(sharded, "adamw")
    _train(sharded, optim, rank % 2, world_size, 0)  # replicas see the same data
    expected = _full_state(sharded, optim)
    model_sd, optim_sd = sw_dcp.get_state_dict(sharded, optim)
    weight = model_sd["blocks.0.qkv.weight"]
    assert weight.device_mesh.ndim == 2 and weight.placements[0].is_replicate(), weight
    _assert_same({"model": model_sd, "optim": optim_sd}, expected)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    torch.manual_seed(99)
    other = ckpt_workers.wrap(models.TinyGPT(), world_size, "HYBRID_SHARD")
    other_optim = parity.make_optimizer(other, "adamw")
    model_sd, optim_sd = sw_dcp.get_state_dict(other, other_optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    sw_dcp.set_state_dict(
        other, other_optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    _assert_same(_full_state(other, other_optim), expected)
    return True


def test_hybrid_shard_saves_each_chunk_once_and_loads_back(tmp_path) -> None:
    assert run_ranks(hybrid_worker, 4, str(tmp_path)) == [True] * 4
