"""Resuming the run, not just the model: RNG streams and the data position.

* Same world size, a model with dropout and an input noise drawn from torch, Python's
  ``random`` and NumPy: the resumed run's losses and parameters are bit-identical to the
  uninterrupted run's (ZeRO-1/2/3 at 2 ranks, hybrid 2x2 at 4).
* 2 -> 3 -> 1 ranks with ``ResumableSampler`` (global batch kept): the global order of the
  samples is the uninterrupted 2-rank run's, every sample of an epoch once, and the
  parameters end within a derived bound of the uninterrupted run's (another world size
  sums the gradients in another order: :func:`resumed_tol`). Hybrid cannot run at 3 or 1
  ranks, so it is covered by the same-world case.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import shardwrap
from shardwrap import ResumableSampler, load_checkpoint, save_checkpoint
from shardwrap.policies import ModuleWrapPolicy
from tests.dist.harness import run_ranks
from tests.dist.refusal_cases import changes, run_snapshot
from tests.tolerances import ADAMW_EPS, reordered_param_atol, step_rounding_rtol

EXACT = {"rtol": 0.0, "atol": 0.0}
NUM_SAMPLES = 18  # three steps an epoch: the 2 -> 3 -> 1 run crosses one in 5 steps
GLOBAL_BATCH = 6  # divides by 1, 2 and 3
LR = 0.02
SEED = 7


class DropoutMLP(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, 16), nn.Dropout(p), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(p)
        )
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(NUM_SAMPLES, 8, generator=g), torch.randn(NUM_SAMPLES, 1, generator=g)


def _build(rank, world_size, strategy, p: float, init_seed: int, global_batch=GLOBAL_BATCH):
    torch.manual_seed(init_seed)
    kwargs = {}
    if strategy.startswith("HYBRID"):
        kwargs["process_group"] = shardwrap.hybrid_process_groups(world_size // 2)
    model = shardwrap.ShardedModule(
        DropoutMLP(p),
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        **kwargs,
    )
    # eps: a reordered comparison's bound (tests/tolerances.py, REORDER_SAFE_ADAMW)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAMW_EPS)
    sampler = ResumableSampler(
        NUM_SAMPLES, global_batch_size=global_batch, rank=rank, world_size=world_size, seed=SEED
    )
    return model, optim, sampler


def _train(
    model, optim, sampler, steps: int, noise: bool, largest_grads: list | None = None
) -> tuple[list[float], list[list]]:
    """``steps`` steps on the sampler's batches (across epochs); losses and local indices.
    ``largest_grads`` gets each step's largest local gradient element."""
    x_all, y_all = _dataset()
    losses, seen = [], []
    while len(losses) < steps:
        for indices in sampler:
            x = x_all[indices]
            if noise:  # every generator a checkpoint restores takes part
                scale = random.random()
                x = x + scale * torch.from_numpy(np.random.randn(*x.shape)).float()
            loss = torch.nn.functional.mse_loss(model(x), y_all[indices])
            loss.backward()
            if largest_grads is not None:
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                largest_grads.append(max(float(g.abs().max()) for g in grads if g.numel()))
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
            seen.append(list(indices))
            if len(losses) == steps:
                break
    return losses, seen


def _seed_streams(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed + 1)
    np.random.seed(seed + 2)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same_world_resume(rank: int, world_size: int, strategy: str, folder: str) -> None:
    batch = 2 * world_size
    model, optim, sampler = _build(rank, world_size, strategy, 0.3, 0, batch)
    _seed_streams(100 + rank)  # every rank draws other dropout masks and noise
    before, _ = _train(model, optim, sampler, 4, noise=True)
    save_checkpoint(folder, model, optim, sampler=sampler, extra={"step": 4})
    after, _ = _train(model, optim, sampler, 5, noise=True)  # crosses into epoch 1
    expected = _params(model)
    del model, optim

    resumed, optim, sampler = _build(rank, world_size, strategy, 0.3, 1, batch)
    _seed_streams(999)  # whatever the new process would have
    assert load_checkpoint(folder, resumed, optim, sampler=sampler) == {"step": 4}
    again, _ = _train(resumed, optim, sampler, 5, noise=True)
    assert again == after, (before, after, again)  # bit for bit
    for got, want in zip(_params(resumed), expected, strict=True):
        torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize(
    ("world_size", "strategy"),
    [(2, "FULL_SHARD"), (2, "SHARD_GRAD_OP"), (2, "SHARD_OPTIM"), (4, "HYBRID_SHARD")],
)
def test_same_world_resume_with_dropout_is_bit_identical(tmp_path, world_size, strategy):
    run_ranks(same_world_resume, world_size, strategy, str(tmp_path / "ckpt"))


def resume_phase(rank, world_size, strategy, load_from, save_to, steps, uninterrupted):
    """Load (if any), train ``steps`` steps, save; or run ``uninterrupted`` steps at once."""
    model, optim, sampler = _build(rank, world_size, strategy, p=0.0, init_seed=0)
    if load_from is not None:
        load_checkpoint(load_from, model, optim, sampler=sampler)
    largest: list[float] = []
    _, seen = _train(model, optim, sampler, steps, noise=False, largest_grads=largest)
    if save_to is not None:
        save_checkpoint(save_to, model, optim, sampler=sampler)
    full = {name: value.clone().numpy() for name, value in model.state_dict().items()}
    return seen, full, max(largest)  # FULL_STATE_DICT: every rank gathers the whole model


def resumed_tol(reordered_steps: int, largest_grad: float) -> dict[str, float]:
    """``assert_close`` keywords for the resumed run's parameters against the uninterrupted
    one's, ``reordered_steps`` of their steps summed in another order: the AdamW bound of
    tests/tolerances.py at ``LR``, its default sums (64 terms, 80 deep: above this MLP's
    17-term, 6-deep ones) and twice the largest gradient element seen as the terms' scale
    (as ``tolerances.GRAD_SCALE`` sits above its models' largest gradients)."""
    atol = reordered_param_atol(reordered_steps, lr=LR, grad_scale=2.0 * largest_grad)
    return {"rtol": step_rounding_rtol(reordered_steps), "atol": atol}


def _global_order(results) -> list[list[int]]:
    """Each step's global batch: the ranks' local batches in rank order."""
    per_rank = [seen for seen, _, _ in results]
    return [sum(parts, []) for parts in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM"])
def test_resume_at_2_then_3_then_1_ranks_keeps_the_global_order(tmp_path, strategy):
    epoch = NUM_SAMPLES // GLOBAL_BATCH
    segments = [(2, 1), (3, 1), (1, epoch - 2 + 2)]  # to the end of epoch 0, two into epoch 1
    total = sum(steps for _, steps in segments)
    reference = run_ranks(resume_phase, 2, strategy, None, None, total, True)
    order, previous = [], None
    for number, (world_size, steps) in enumerate(segments):
        target = str(tmp_path / f"ckpt{number}")
        results = run_ranks(resume_phase, world_size, strategy, previous, target, steps, False)
        order += _global_order(results)
        previous = target
    assert order == _global_order(reference)
    first_epoch = sum(order[:epoch], [])
    assert sorted(first_epoch) == list(range(NUM_SAMPLES))  # each sample once
    assert len(set(sum(order[epoch:], []))) == 2 * GLOBAL_BATCH
    got, want = results[0][1], reference[0][1]
    assert set(got) == set(want)
    # the first segment runs as the reference does; the others sum in other orders (seen:
    # 4.5e-8 apart, bound 6.2e-3 from a largest gradient of 1.37; control: the loss doubled
    # in the 1-rank segment failed it by 1.6e-2)
    tol = resumed_tol(total - segments[0][1], max(largest for _, _, largest in reference))
    for name in want:
        torch.testing.assert_close(
            torch.from_numpy(got[name]), torch.from_numpy(want[name]), msg=name, **tol
        )


def refused_on_one_rank(rank: int, world_size: int, folder: str) -> None:
    """Rank 1's run file is damaged: rank 0 could load, but no rank may change anything."""
    model, optim, sampler = _build(rank, world_size, "FULL_SHARD", 0.0, 0)
    _train(model, optim, sampler, 2, noise=False)
    save_checkpoint(folder, model, optim, sampler=sampler)
    if rank == 1:
        (run_file,) = [p for p in os.listdir(folder) if p.endswith("-rank00001.run.json")]
        with open(os.path.join(folder, run_file), "w") as handle:
            handle.write("{ damaged")
    _train(model, optim, sampler, 1, noise=False)
    _seed_streams(50 + rank)
    before = run_snapshot(model, optim, sampler)  # parameters, optimizer, sampler, streams
    with pytest.raises(shardwrap.CheckpointError, match="rank 1"):
        load_checkpoint(folder, model, optim, sampler=sampler)
    assert changes(before, run_snapshot(model, optim, sampler)) == []


def test_a_load_one_rank_refuses_changes_no_rank(tmp_path):
    run_ranks(refused_on_one_rank, 2, str(tmp_path))
