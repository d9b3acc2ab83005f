"""NO_SHARD keeps its flat gradient buffer across steps, never under a live gradient.

See [Note: reusing the data-parallel gradient buffer] in ``shardwrap/core/grad_buffers.py`` and
[Note: in-place buckets] in ``shardwrap/runtime/reduce_bucket.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwrap
from shardwrap.assemble.root import root_of
from tests import models, tolerances
from tests.dist.harness import run_ranks
from tests.dist.parity import build_model, wrap_policy


def _reference_grads(
    rank: int, world_size: int, seeds: list[int], magnitudes: dict | None = None
) -> dict[str, torch.Tensor]:
    """Unsharded: the average over ranks of the gradients summed over ``seeds``.
    ``magnitudes`` gets, per parameter, the average over ranks of the sums of the
    per-seed gradients' magnitudes (the terms' scale of that sum)."""
    reference = build_model("mlp")
    for seed in seeds:
        previous = {
            n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None
        }
        models.mlp_loss(reference, models.mlp_batch(seed * world_size + rank)).backward()
        if magnitudes is not None:
            for name, param in reference.named_parameters():
                term = (param.grad - previous.get(name, 0.0)).abs()
                magnitudes[name] = magnitudes.get(name, 0.0) + term
    grads = {}
    for name, param in reference.named_parameters():
        total = param.grad.clone()
        dist.all_reduce(total)
        grads[name] = total / world_size
        if magnitudes is not None:
            dist.all_reduce(magnitudes[name])
            magnitudes[name] /= world_size
    return grads


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def _same(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return grads.keys() == expected.keys() and all(
        torch.equal(grads[k], expected[k]) for k in expected
    )


def _close(grads: dict, expected: dict, magnitudes: dict, num_terms: int) -> bool:
    """Equal up to rounding: reducing per step and then summing adds the same
    ``num_terms`` per-rank, per-step gradients in another order, so each element is within
    ``tolerances.short_sum_relative`` of their magnitudes' sum (the per-step gradients
    themselves are equal bit for bit: ``_same`` above)."""
    relative = tolerances.short_sum_relative(num_terms)
    return grads.keys() == expected.keys() and all(
        bool(((grads[k] - expected[k]).abs() <= relative * magnitudes[k]).all()) for k in expected
    )


def _storages(grads: dict[str, torch.Tensor]) -> set[int]:
    return {g.untyped_storage().data_ptr() for g in grads.values()}


def _backward(model, rank: int, world_size: int, seed: int) -> None:
    models.mlp_loss(model, models.mlp_batch(seed * world_size + rank)).backward()


def _num_allocated(model, seen: set) -> int:
    """Gradient buffers created so far: the units' own, or the in-place buckets'.

    ``seen``: the keepers found by earlier calls, so a replaced one still counts.
    """
    schedule = root_of(model).runtime.schedule
    seen.update(u.handle.grads._grad_buffer for u in model.units if u.handle is not None)
    seen.update(schedule.bucket_slots.buffers())
    return sum(b.num_allocated for b in seen)


def _worker(rank: int, world_size: int, bucket_bytes: int) -> dict:
    model = shardwrap.ShardedModule(
        build_model("mlp"), sharding_strategy="NO_SHARD", auto_wrap_policy=wrap_policy("mlp")
    )
    model.set_reduce_bucket_size(bucket_bytes)
    result = {}
    keepers = set()
    _backward(model, rank, world_size, seed=0)
    held = _grads(model)  # the user keeps step 0's gradients past zero_grad
    held_values = {k: g.clone() for k, g in held.items()}
    result["step0"] = _same(held, _reference_grads(rank, world_size, [0]))
    model.zero_grad(set_to_none=True)

    _backward(model, rank, world_size, seed=1)
    step1 = _grads(model)
    result["step1"] = _same(step1, _reference_grads(rank, world_size, [1]))
    result["held_untouched"] = _same(held, held_values)
    result["held_storage_not_reused"] = not (_storages(held) & _storages(step1))
    step1_storages = _storages(step1)
    allocated_by_step1 = _num_allocated(model, keepers)
    del held, step1
    model.zero_grad(set_to_none=True)

    _backward(model, rank, world_size, seed=2)
    step2 = _grads(model)
    result["step2"] = _same(step2, _reference_grads(rank, world_size, [2]))
    result["reused"] = _storages(step2) == step1_storages
    result["nothing_new"] = _num_allocated(model, keepers) == allocated_by_step1
    del step2

    _backward(model, rank, world_size, seed=3)  # no zero_grad: gradients accumulate
    magnitudes: dict = {}
    expected = _reference_grads(rank, world_size, [2, 3], magnitudes)
    result["accumulated"] = _close(_grads(model), expected, magnitudes, 2 * world_size)
    return result


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 30], ids=["per_unit", "one_bucket"])
def test_no_shard_reuses_its_gradient_buffer_only_when_free(bucket_bytes: int) -> None:
    for result in run_ranks(_worker, 2, bucket_bytes):
        assert result == {
            "step0": True,
            "step1": True,
            "held_untouched": True,
            "held_storage_not_reused": True,
            "step2": True,
            "reused": True,
            "nothing_new": True,
            "accumulated": True,
        }


def _sharded_worker(rank: int, world_size: int) -> dict:
    model = shardwrap.ShardedModule(
        build_model("mlp"), sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy=wrap_policy("mlp")
    )
    pool = root_of(model).runtime.schedule.scratch
    allocated = []
    for seed in range(3):
        _backward(model, rank, world_size, seed=seed)
        allocated.append(pool.num_allocated)
        model.zero_grad(set_to_none=True)
    return {"allocated": allocated, "capacity": pool.capacity}


def test_sharded_units_share_reduce_scatter_inputs_across_steps() -> None:
    for result in run_ranks(_sharded_worker, 2):
        first, *later = result["allocated"]
        assert first >= 1
        assert later == [first, first]  # nothing new after the first step
