"""DiskOffload's step streamed in sub-groups: the cut, parity, refusals and its peak memory."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import shardwrap
from shardwrap.offload.disk_step import PIECE_ALIGNMENT, sub_groups
from tests import models
from tests.dist import disk_cases


@pytest.mark.parametrize(
    "value,error", [(0, ValueError), (-5, ValueError), (True, TypeError), (1e6, TypeError)]
)
def test_sub_group_size_is_validated(value, error):
    with pytest.raises(error, match="DiskOffload: sub_group_size"):
        shardwrap.DiskOffload("/tmp", sub_group_size=value)


@given(
    numels=st.lists(st.integers(min_value=0, max_value=300), max_size=8),
    size=st.integers(min_value=1, max_value=200),
)
def test_sub_groups_cover_every_element_once_in_order(numels, size):
    params = [(index % 2, torch.empty(n)) for index, n in enumerate(numels)]
    groups = list(sub_groups(params, size))
    for group in groups:
        assert sum(s.end - s.start for s in group) <= max(size, PIECE_ALIGNMENT)
    covered: dict[int, list[tuple[int, int]]] = {}
    for group in groups:
        for piece in group:
            assert piece.start % PIECE_ALIGNMENT == 0  # where the whole's SIMD vectors start
            covered.setdefault(id(piece.param), []).append((piece.group_index, piece.start))
            covered[id(piece.param)].append((piece.group_index, piece.end))
    for group_index, param in params:
        bounds = covered[id(param)]  # empty parameters too: the optimizer counts their step
        assert {g for g, _ in bounds} == {group_index}
        ends = [b for _, b in bounds]
        assert ends[0] == 0 and ends[-1] == param.numel() and ends == sorted(ends)
        assert all(ends[i] == ends[i + 1] for i in range(1, len(ends) - 1, 2))  # no gap


def _fused_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True)


@pytest.mark.parametrize(
    "make_optimizer", [disk_cases._adamw, disk_cases._adam_amsgrad, _fused_adamw]
)
def test_unsharded_shapes_match_memory(one_rank, tmp_path, make_optimizer):
    """NO_SHARD: pieces are cut from 2-D parameters; the fused kernel needs aligned cuts."""
    left = disk_cases.streamed_matches_memory(0, 1, str(tmp_path), "NO_SHARD", make_optimizer)
    assert left == []


def _extra_and_model(offload):
    torch.manual_seed(0)
    extra = nn.Parameter(torch.randn(7))  # not the store's: the optimizer's real step has it
    model = shardwrap.ShardedModule(models.MLP(), cpu_offload=offload)
    groups = [{"params": list(model.parameters())}, {"params": [extra], "lr": 0.05}]
    return extra, model, torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)


def test_other_parameters_of_the_optimizer_step_and_grads_come_back(one_rank, tmp_path):
    runs = [_extra_and_model(None), _extra_and_model(shardwrap.DiskOffload(str(tmp_path), 5))]
    for seed in range(3):
        for extra, model, optim in runs:
            loss = models.mlp_loss(model, models.mlp_batch(seed)) + extra.square().sum()
            loss.backward()
            optim.step()
        (kept_extra, kept, _), (extra, streamed, optim) = runs
        assert streamed.disk_store.num_sub_groups(optim) > 1
        torch.testing.assert_close(extra, kept_extra, rtol=0, atol=0)
        for p, q in zip(streamed.parameters(), kept.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)  # given back
        for _, _, optim in runs:
            optim.zero_grad()


def test_closure_is_refused_only_when_streamed(one_rank, tmp_path):
    for size, streamed in ((1_000_000_000, False), (5, True)):
        model = shardwrap.ShardedModule(
            models.MLP(), cpu_offload=shardwrap.DiskOffload(str(tmp_path), sub_group_size=size)
        )
        optim = torch.optim.Adam(model.parameters(), lr=0.01)

        def closure(model=model, optim=optim):
            optim.zero_grad()
            loss = models.mlp_loss(model, models.mlp_batch(0))
            loss.backward()
            return loss

        closure()
        if streamed:
            with pytest.raises(ValueError, match="sub_group_size=5.*cannot take a closure"):
                optim.step(closure)
        else:
            assert torch.is_tensor(optim.step(closure))


def _status_kib() -> dict[str, int]:
    with open("/proc/self/status") as status:
        pairs = (line.split(":", 1) for line in status)
        return {k: int(v.split()[0]) for k, v in pairs if k in ("VmRSS", "VmHWM")}


def _step_peak_rise_kib(optim: torch.optim.Optimizer) -> int:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # the peak (VmHWM) restarts from the current resident set
    before = _status_kib()["VmRSS"]
    optim.step()
    return _status_kib()["VmHWM"] - before


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs"
)
def test_streamed_step_holds_about_one_sub_group(one_rank, tmp_path):
    """The step's peak rise: all Adam state at once in one group, a sub-group's when streamed."""
    rises = {}
    for size in (1_000_000_000, 65_536):
        torch.manual_seed(0)
        plain = models.MLP(dim=256, hidden=1024, depth=4)  # ~0.8M params: 8 bytes each of state
        reference = copy.deepcopy(plain)
        model = shardwrap.ShardedModule(
            plain, cpu_offload=shardwrap.DiskOffload(str(tmp_path), sub_group_size=size)
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        rises[size] = []
        for _ in range(2):
            batch = (torch.randn(8, 256), torch.randn(8, 1))
            models.mlp_loss(model, batch).backward()
            models.mlp_loss(reference, batch).backward()
            rises[size].append(_step_peak_rise_kib(optim))
            ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        state_kib = 8 * sum(p.numel() for p in reference.parameters()) // 1024
    # One group: the step brings back every exp_avg/exp_avg_sq page (6.5 MiB here).
    assert min(rises[1_000_000_000]) > state_kib // 2, (rises, state_kib)
    # Streamed: about one sub-group (65,536 elements x 12 bytes = 768 KiB) plus temporaries.
    assert max(rises[65_536]) < state_kib // 4, (rises, state_kib)
