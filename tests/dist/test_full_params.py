"""summon_full_params, register_forward_method and evaluation-mode forwards."""

from __future__ import annotations

import copy

import pytest
import torch

import shardwrap
from shardwrap.flat_param import ShardedState
from tests import models
from tests.dist.harness import STRATEGIES, WORLD_SIZES, run_ranks
from tests.dist.parity import (
    Case,
    batch_for,
    check_shards,
    concat,
    loss_for,
    make_optimizer,
    reordered_tol,
    wrap_case,
)
from tests.tolerances import REORDERED_GRAD_TOL

EXACT = {"rtol": 0.0, "atol": 0.0}
GRADS = REORDERED_GRAD_TOL  # summed over the ranks' batches, against the whole batch's


class GenGPT(models.TinyGPT):
    """TinyGPT with a greedy ``generate`` that reads root-unit parameters outside forward."""

    def generate(self, idx: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x[:, -1]))
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
        return idx


def _fresh(strategy: str):
    torch.manual_seed(1234)
    model = GenGPT()
    reference = copy.deepcopy(model)
    return wrap_case(model, Case(strategy=strategy)), reference


def _full_named(sharded) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in sharded.named_parameters()}


def _check_summon(sharded, reference, world_size: int) -> None:
    ref = dict(reference.named_parameters())
    with shardwrap.ShardedModule.summon_full_params(sharded):
        for name, value in _full_named(sharded).items():
            torch.testing.assert_close(value, ref[name].detach(), **EXACT)
    # writeback=True: edits reach the shards (and the next gather).
    with sharded.summon_full_params(sharded), torch.no_grad():
        for p in sharded.parameters():
            p.mul_(0.5).add_(0.01)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.5).add_(0.01)
    check_shards(sharded, reference, exact=True)
    # writeback=False: edits are dropped, also for strategies that keep the gathered buffer.
    with sharded.summon_full_params(sharded, writeback=False), torch.no_grad():
        for p in sharded.parameters():
            p.zero_()
    check_shards(sharded, reference, exact=True)
    # recurse=False: only the root unit's parameters are full.
    block_numel = sum(p.numel() for p in reference.blocks[0].parameters())
    with sharded.summon_full_params(sharded, recurse=False):
        assert sharded.module.tok.weight.shape == reference.tok.weight.shape
        shown = sum(p.numel() for p in sharded.module.blocks[0].parameters())
        assert (shown == block_numel) == (sharded.units[1].handle.num_shards == 1)
    # Nested: the inner context leaves units the outer one summoned alone.
    full_shape = reference.blocks[0].fc.weight.shape
    with sharded.summon_full_params(sharded):
        with sharded.summon_full_params(sharded.module.blocks[0]):
            assert sharded.module.blocks[0].fc.weight.shape == full_shape
        assert sharded.module.blocks[0].fc.weight.shape == full_shape
    check_shards(sharded, reference, exact=True)
    # rank0_only: full on global rank 0 only.
    with sharded.summon_full_params(sharded, rank0_only=True, writeback=False):
        full = sharded.module.tok.weight.shape == reference.tok.weight.shape
        rank = torch.distributed.get_rank()
        assert full == (rank == 0 or sharded.units[0].handle.num_shards == 1)


def _check_with_grads(sharded, reference, world_size: int, rank: int) -> None:
    optim, ref_optim = make_optimizer(sharded, "sgd"), make_optimizer(reference, "sgd")
    batches = [batch_for("gpt", 77 + r) for r in range(world_size)]
    loss_for("gpt", reference, concat(batches), 1).backward()
    loss_for("gpt", sharded, batches[rank], 1).backward()
    ref = dict(reference.named_parameters())
    with sharded.summon_full_params(sharded, with_grads=True, writeback=False):
        for name, p in sharded.named_parameters():
            if ref[name].grad is None:
                assert p.grad is None, name
            else:
                expected = ref[name].grad
                torch.testing.assert_close(p.grad, expected, msg=lambda m, n=name: n + m, **GRADS)
    optim.step()
    ref_optim.step()
    check_shards(sharded, reference, exact=False, tol=reordered_tol("sgd", 1))


def _check_generate(sharded, reference) -> None:
    prompt = batch_for("gpt", 5)[0][:, :4]
    with torch.no_grad():
        expected = reference.generate(prompt, steps=8)
    sharded.register_forward_method(sharded, "generate")
    sharded.comm_ledger.reset()
    with torch.no_grad():
        tokens = sharded.generate(prompt, steps=8)
    torch.testing.assert_close(tokens, expected, **EXACT)
    for unit in sharded.units:
        assert unit.handle is None or unit.handle.state is ShardedState.SHARDED, unit
    assert sharded.comm_ledger.count("reduce_scatter") == 0


def _check_eval(sharded, reference, grad_mode) -> dict:
    idx = batch_for("gpt", 9)[0]
    sharded.eval()
    reference.eval()
    sharded.comm_ledger.reset()
    with grad_mode():
        out = sharded(idx)
        ref_out = reference(idx)
    sharded.train()
    reference.train()
    torch.testing.assert_close(out, ref_out, **EXACT)
    assert not out.requires_grad
    assert sharded.comm_ledger.count("reduce_scatter") == 0
    assert sharded.comm_ledger.count("all_reduce") == 0
    for unit in sharded.units:
        handle = unit.handle
        if handle is None:
            continue
        assert handle.state is ShardedState.SHARDED, unit
        if unit.strategy.free_after_backward:
            assert handle.full_storage_bytes == 0, unit
    return {"gathers": sharded.comm_ledger.count("all_gather", "params")}


def full_params_worker(rank: int, world_size: int) -> dict:
    results = {}
    for strategy in STRATEGIES:
        sharded, reference = _fresh(strategy)
        _check_summon(sharded, reference, world_size)
        _check_with_grads(sharded, reference, world_size, rank)
        # the step summed in another order than the reference's: from here on the
        # reference holds the sharded parameters, so generate and eval compare exactly
        reference.load_state_dict(sharded.state_dict())
        _check_generate(sharded, reference)
        results[strategy] = {
            mode.__name__: _check_eval(sharded, reference, mode)
            for mode in (torch.no_grad, torch.inference_mode)
        }
    sharded, _ = _fresh("FULL_SHARD")
    if world_size > 1:  # without registration, generate sees 1-D shard pieces
        with pytest.raises(RuntimeError), torch.no_grad():
            sharded.generate(batch_for("gpt", 5)[0][:, :4], steps=1)
    results["errors"] = _bad_flag_messages()
    return results


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_full_params_generate_and_eval(world_size):
    results = run_ranks(full_params_worker, world_size)
    for per_rank in results:
        messages = per_rank.pop("errors")
        assert len(messages) == 3, messages
        assert "rank0_only" in messages[0] and "recurse" in messages[1]
        assert "no_such_method" in messages[2]
        for strategy, modes in per_rank.items():
            for mode, counts in modes.items():
                units_with_params = 3  # root + two blocks
                if world_size > 1 and strategy != "NO_SHARD":
                    assert counts["gathers"] <= units_with_params, (strategy, mode, counts)


def _bad_flag_messages() -> list[str]:
    sharded, _ = _fresh("FULL_SHARD")
    messages = []
    for kwargs in ({"writeback": True, "rank0_only": True}, {"recurse": "yes"}):
        try:
            with sharded.summon_full_params(sharded, **kwargs):
                pass
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    try:
        sharded.register_forward_method(sharded, "no_such_method")
    except ValueError as exc:
        messages.append(str(exc))
    return messages
