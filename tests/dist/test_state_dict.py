"""FSDP-style state dicts: whole tensors under the unwrapped names, loadable across strategies."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from shardwrap import ShardedModule
from shardwrap.options import FullStateDictConfig, StateDictType
from tests import models, tolerances
from tests.dist import ckpt_workers, parity
from tests.dist.harness import run_ranks

EXACT = {"rtol": 0.0, "atol": 0.0}


def _train(sharded, optim, reference, ref_optim, world_size, rank, first_step):
    # the run and its reference are apart by the reordered steps before first_step
    ckpt_workers.train_steps(
        sharded, optim, reference, ref_optim, world_size, rank, first_step, first_step
    )


def _check_full_matches_pieces(sharded, optim, model_sd, optim_sd):
    """Every local piece is the matching slice of the gathered whole tensors, bit for bit."""
    for name, (_shape, start, end, flat, state) in ckpt_workers.local_pieces(
        sharded, optim
    ).items():
        torch.testing.assert_close(model_sd[name].reshape(-1)[start:end], flat, **EXACT)
        for key, value in state.items():
            whole = optim_sd["state"][name][key]
            got = whole if key == "step" else whole.reshape(-1)[start:end]
            torch.testing.assert_close(got, value, **EXACT, msg=f"{name}/{key}")


def state_dict_worker(rank, world_size, source_strategy, target_strategy):
    torch.manual_seed(1234)
    model = models.TinyGPT()
    reference = copy.deepcopy(model)
    sharded = ckpt_workers.wrap(model, world_size, source_strategy)
    optim = parity.make_optimizer(sharded, "adamw")
    ref_optim = parity.make_optimizer(reference, "adamw")
    _train(sharded, optim, reference, ref_optim, world_size, rank, 0)

    model_sd = sharded.state_dict()  # FULL_STATE_DICT is the default
    assert list(model_sd) == list(reference.state_dict()), list(model_sd)
    steps = ckpt_workers.STEPS_PER_PHASE
    params_tol = parity.reordered_tol("adamw", steps) if world_size > 1 else EXACT
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model_sd[key], value, msg=key, **params_tol)
    optim_sd = ShardedModule.optim_state_dict(sharded, optim)
    ref_names = {id(p): n for n, p in reference.named_parameters()}
    for param, state in ref_optim.state.items():
        for key, value in state.items():
            tol = parity.optimizer_state_tol(key, world_size)
            torch.testing.assert_close(optim_sd["state"][ref_names[id(param)]][key], value, **tol)
    _check_full_matches_pieces(sharded, optim, model_sd, optim_sd)
    buffer = io.BytesIO()
    torch.save(model_sd, buffer)  # the classic script keeps working
    plain = models.TinyGPT()
    plain.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))

    with ShardedModule.state_dict_type(
        sharded, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)
    ):
        only0 = sharded.state_dict()
        assert (only0 == {}) == (rank != 0)
    assert ShardedModule.get_state_dict_type(sharded).state_dict_type.name == "FULL_STATE_DICT"

    # Into another strategy: load both, then both models train on alike.
    torch.manual_seed(99)
    other = ckpt_workers.wrap(models.TinyGPT(), world_size, target_strategy)
    other_optim = parity.make_optimizer(other, "adamw")
    result = other.load_state_dict(model_sd)
    assert not result.missing_keys and not result.unexpected_keys
    to_load = ShardedModule.optim_state_dict_to_load(other, other_optim, optim_sd)
    other_optim.load_state_dict(to_load)
    _check_full_matches_pieces(other, other_optim, model_sd, optim_sd)
    second_reference = copy.deepcopy(reference)
    second_ref_optim = parity.make_optimizer(second_reference, "adamw")
    second_ref_optim.load_state_dict(copy.deepcopy(ref_optim.state_dict()))
    _train(sharded, optim, reference, ref_optim, world_size, rank, 2)
    _train(other, other_optim, second_reference, second_ref_optim, world_size, rank, 2)

    with ShardedModule.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
        local = {k: v.clone() for k, v in other.state_dict().items()}  # views, like torch
        local_optim = ShardedModule.optim_state_dict(other, other_optim)
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        other.load_state_dict(local)
        other_optim.load_state_dict(
            ShardedModule.optim_state_dict_to_load(other, other_optim, local_optim)
        )
    steps = 2 * ckpt_workers.STEPS_PER_PHASE
    parity.check_shards(
        other, second_reference, world_size == 1, parity.reordered_tol("adamw", steps)
    )
    return True


@pytest.mark.parametrize(
    ("world_size", "source", "target"),
    [(4, "HYBRID_SHARD", "NO_SHARD"), (3, "SHARD_OPTIM", "SHARD_GRAD_OP")],
)
def test_full_state_dicts_round_trip_across_strategies(world_size, source, target):
    assert run_ranks(state_dict_worker, world_size, source, target) == [True] * world_size


def _parent_with_sharded_child(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(plain parent holding a FULL_SHARD child, the same model unwrapped)."""
    torch.manual_seed(seed)
    reference = torch.nn.Sequential(torch.nn.Linear(3, 12), models.MLP())
    parent = copy.deepcopy(reference)
    parent[1] = ShardedModule(parent[1])
    return parent, reference


def parent_load_worker(rank, world_size):
    source, reference = _parent_with_sharded_child(seed=1)
    target, _ = _parent_with_sharded_child(seed=2)  # different weights until loaded
    saved = source.state_dict()
    assert list(saved) == list(reference.state_dict())
    result = target.load_state_dict(saved)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(target.state_dict()[key], value, **EXACT, msg=key)
    x = torch.randn(5, 3)
    # Weights are equal bit for bit, but the gathered ones are views at unaligned offsets of
    # a flat buffer, where MKL blocks the matmul otherwise: a derived bound (seen: up to
    # 1.5e-8 apart, bound about 6e-5; controls: one tensor left unloaded gave 4.8e-2, one
    # row of the first weight copied from the next 7.2e-3)
    atol = tolerances.reordered_forward_atol(reference, x)
    torch.testing.assert_close(target(x), reference(x), rtol=0.0, atol=atol)

    partial = {k: v for k, v in saved.items() if k != "1.head.bias"}
    partial["1.stray"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as error:
        target.load_state_dict(partial)
    message = str(error.value)
    assert '"1.head.bias"' in message and '"1.stray"' in message and "module." not in message
    loose = target.load_state_dict(partial, strict=False)
    assert loose.missing_keys == ["1.head.bias"] and loose.unexpected_keys == ["1.stray"]


def test_plain_parent_loads_a_sharded_child() -> None:
    run_ranks(parent_load_worker, 2)
