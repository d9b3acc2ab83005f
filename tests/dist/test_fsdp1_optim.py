"""FSDP1's optimizer-state calls round-trip exactly over two ranks (issue #19, items 2-3).

One spawned pair of ranks checks every path: each saved form is loaded into a fresh model
and optimizer, whose state must equal the saved one bit for bit and whose next steps must
equal uninterrupted training bit for bit.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.fsdp as torch_fsdp

from shardwrap import FullyShardedDataParallel as FSDP
from tests import models
from tests.dist import parity
from tests.dist.harness import run_ranks

EXACT = {"rtol": 0.0, "atol": 0.0}


def _wrap(seed: int) -> FSDP:
    torch.manual_seed(seed)
    return FSDP(  # torch's own option objects, as accelerate passes them
        models.TinyGPT(),
        sharding_strategy=torch_fsdp.ShardingStrategy.FULL_SHARD,
        cpu_offload=torch_fsdp.CPUOffload(offload_params=False),
        auto_wrap_policy=parity.wrap_policy("gpt"),
        backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_PRE,
        mixed_precision=torch_fsdp.MixedPrecision(),
        device_id=torch.device("cpu"),
        limit_all_gathers=True,
        use_orig_params=False,
    )


def _steps(model: FSDP, optim: torch.optim.Optimizer, rank: int, first: int, count: int) -> None:
    for step in range(first, first + count):
        batch = torch.randint(
            0, 64, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank)
        )
        model(batch).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def _local(model: FSDP) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _check_state(optim: torch.optim.Optimizer, saved: dict, path: str) -> None:
    ours = optim.state_dict()
    assert ours["param_groups"] == saved["param_groups"], path
    assert sorted(ours["state"]) == sorted(saved["state"]), path
    for key, state in saved["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(
                ours["state"][key][name], value, **EXACT, msg=f"{path} {key}/{name}"
            )


def roundtrip_worker(rank: int, world_size: int) -> list[str]:
    warnings.simplefilter("ignore", FutureWarning)  # the legacy calls warn, as torch's do
    model = _wrap(0)
    optim = parity.make_optimizer(model, "adamw")
    _steps(model, optim, rank, 0, 2)
    saved_local = optim.state_dict()
    saved_local = {
        "state": {k: {n: v.clone() for n, v in s.items()} for k, s in saved_local["state"].items()},
        "param_groups": saved_local["param_groups"],
    }
    model_sd = model.state_dict()
    forms = {
        "full_rank0": FSDP.full_optim_state_dict(model, optim),  # rank0_only=True default
        "full_all": FSDP.full_optim_state_dict(model, optim, rank0_only=False),
        "sharded": FSDP.sharded_optim_state_dict(model, optim),
    }
    assert (forms["full_rank0"] == {}) == (rank != 0)
    plain_names = [n for n, _ in models.TinyGPT().named_parameters()]
    assert "tok.weight" in forms["full_all"]["state"]  # keyed by the unwrapped names
    assert set(forms["full_all"]["state"]) <= set(plain_names)
    forms["ids"] = FSDP.rekey_optim_state_dict(
        forms["full_all"], torch_fsdp.OptimStateKeyType.PARAM_ID, model
    )
    assert all(isinstance(k, int) for k in forms["ids"]["state"])
    names = FSDP.rekey_optim_state_dict(
        forms["ids"], torch_fsdp.OptimStateKeyType.PARAM_NAME, model
    )
    assert names["state"].keys() == forms["full_all"]["state"].keys()
    # accelerate's four-argument form; rank0_only for the optimizer config too.
    with FSDP.state_dict_type(
        model,
        torch_fsdp.StateDictType.FULL_STATE_DICT,
        torch_fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ):
        settings = FSDP.get_state_dict_type(model)
        assert settings.optim_state_dict_config.rank0_only
        forms["accelerate"] = FSDP.optim_state_dict(model, optim)
        assert (forms["accelerate"] == {}) == (rank != 0)
    assert not FSDP.get_state_dict_type(model).optim_state_dict_config.rank0_only
    _steps(model, optim, rank, 2, 2)
    expected = _local(model)

    def load(path: str, fresh: FSDP, fresh_optim):
        if path == "full_rank0":
            return FSDP.scatter_full_optim_state_dict(
                forms[path] if rank == 0 else None, fresh, optim=fresh_optim
            )
        if path in ("full_all", "ids"):
            return FSDP.shard_full_optim_state_dict(forms[path], fresh, optim=fresh_optim)
        if path == "sharded":
            return FSDP.flatten_sharded_optim_state_dict(forms[path], fresh, fresh_optim)
        with FSDP.state_dict_type(
            fresh,
            torch_fsdp.StateDictType.FULL_STATE_DICT,
            torch_fsdp.FullStateDictConfig(rank0_only=True),
            torch_fsdp.FullOptimStateDictConfig(rank0_only=True),
        ):
            return FSDP.optim_state_dict_to_load(fresh, fresh_optim, forms[path] or None)

    done = []
    for path in ("full_rank0", "full_all", "ids", "sharded", "accelerate"):
        fresh = _wrap(7)
        fresh.load_state_dict(model_sd)
        fresh_optim = parity.make_optimizer(fresh, "adamw")
        fresh_optim.load_state_dict(load(path, fresh, fresh_optim))
        _check_state(fresh_optim, saved_local, path)
        _steps(fresh, fresh_optim, rank, 2, 2)
        for got, want in zip(_local(fresh), expected, strict=True):
            torch.testing.assert_close(got, want, **EXACT, msg=path)
        done.append(path)
    # Without optim: the optimizer is assumed built over the saved groups in model order.
    fresh = _wrap(7)
    without = FSDP.shard_full_optim_state_dict(forms["full_all"], fresh)
    assert [len(g["params"]) for g in without["param_groups"]] == [
        len(g["params"]) for g in saved_local["param_groups"]
    ]
    return done


def test_fsdp1_optimizer_state_round_trips():
    results = run_ranks(roundtrip_worker, 2)
    assert results == [["full_rank0", "full_all", "ids", "sharded", "accelerate"]] * 2
