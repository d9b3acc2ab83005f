"""ResumableSampler: the global order does not depend on the world size, and a resume at
another world size continues it (every sample of an epoch exactly once)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from shardwrap.data.sampler import (
    ResumableSampler,
    batches_left,
    epoch_order,
    local_batch_size,
    rank_span,
)


def _samplers(num_samples, global_batch, world_size, **kwargs):
    return [
        ResumableSampler(
            num_samples, global_batch_size=global_batch, rank=r, world_size=world_size, **kwargs
        )
        for r in range(world_size)
    ]


def _global_steps(samplers, steps=None):
    """Run the ranks' samplers side by side; each step's global batch (rank order)."""
    iterators = [iter(s) for s in samplers]
    batches = []
    while steps is None or len(batches) < steps:
        try:
            parts = [next(it) for it in iterators]
        except StopIteration:
            break
        batches.append([i for part in parts for i in part])
    return batches


@st.composite
def _runs(draw):
    """An epoch, a global batch, and a list of (world size, steps) segments of one run."""
    num_samples = draw(st.integers(1, 60))
    local = draw(st.integers(1, 4))
    worlds = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    global_batch = math.lcm(*worlds) * local
    segments = [(w, draw(st.integers(0, 5))) for w in worlds]
    return num_samples, global_batch, segments, draw(st.integers(0, 2**31)), draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(_runs())
def test_resumed_at_other_world_sizes_the_order_is_the_uninterrupted_one(run):
    num_samples, global_batch, segments, seed, shuffle = run
    kwargs = {"seed": seed, "shuffle": shuffle}
    reference = _global_steps(_samplers(num_samples, global_batch, 1, **kwargs))
    seen, state = [], None
    for world_size, steps in segments:
        samplers = _samplers(num_samples, global_batch, world_size, **kwargs)
        if state is not None:
            for sampler in samplers:
                sampler.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint has it
        seen += _global_steps(samplers, min(steps, len(samplers[0])))  # within the epoch
        state = samplers[0].state_dict()
        assert all(s.state_dict() == state for s in samplers)
    last_world = segments[-1][0]
    samplers = _samplers(num_samples, global_batch, last_world, **kwargs)
    for sampler in samplers:
        sampler.load_state_dict(state)
    seen += _global_steps(samplers)  # to the end of the epoch
    assert seen == reference
    flat = [i for batch in seen for i in batch]
    assert len(flat) == len(set(flat)) == (num_samples // global_batch) * global_batch
    assert set(flat) <= set(range(num_samples))


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 200), st.integers(1, 8), st.integers(0, 1000), st.integers(0, 5), st.booleans()
)
def test_rank_spans_tile_each_global_batch(num_samples, world_size, seed, epoch, shuffle):
    order = epoch_order(num_samples, seed, epoch, shuffle)
    assert sorted(order) == list(range(num_samples))
    global_batch = world_size * 3
    for batch in range(batches_left(num_samples, 0, global_batch)):
        position = batch * global_batch
        spans = [rank_span(position, global_batch, r, world_size) for r in range(world_size)]
        assert spans[0][0] == position and spans[-1][1] == position + global_batch
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_epochs_differ_and_an_epoch_run_to_its_end_moves_on():
    sampler = ResumableSampler(12, global_batch_size=4, rank=0, world_size=1, seed=3)
    first = list(sampler)
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["position"] == 0
    second = list(sampler)
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))
    sampler.set_epoch(0)
    assert list(sampler) == first
    assert epoch_order(12, 3, 0, True) == sum(first, [])
    assert epoch_order(12, 3, 1, True) != epoch_order(12, 4, 0, True)


def test_set_epoch_keeps_the_position_of_the_current_epoch():
    sampler = ResumableSampler(12, global_batch_size=2, rank=1, world_size=2)
    iterator = iter(sampler)
    next(iterator), next(iterator)
    sampler.set_epoch(0)
    assert sampler.state_dict()["position"] == 4 and len(sampler) == 4
    sampler.set_epoch(5)
    assert sampler.state_dict()["position"] == 0 and sampler.state_dict()["epoch"] == 5


def test_works_as_a_dataloader_batch_sampler():
    data = torch.arange(100, 120)
    samplers = _samplers(20, 6, 2, seed=1)
    loaders = [DataLoader(data, batch_sampler=s) for s in samplers]
    assert [len(loader) for loader in loaders] == [3, 3]
    steps = [torch.cat(parts).tolist() for parts in zip(*loaders, strict=True)]
    order = epoch_order(20, 1, 0, True)
    assert steps == [[100 + i for i in order[k * 6 : (k + 1) * 6]] for k in range(3)]


def test_a_global_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="global_batch_size: 10 does not divide by world_size 3"):
        ResumableSampler(30, global_batch_size=10, rank=0, world_size=3)
    with pytest.raises(ValueError, match="global_batch_size"):
        local_batch_size(7, 2)
    with pytest.raises(ValueError, match="rank: must be < world_size 2"):
        ResumableSampler(30, global_batch_size=4, rank=2, world_size=2)
    with pytest.raises(TypeError, match="num_samples"):
        ResumableSampler(3.0, global_batch_size=4, rank=0, world_size=2)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("num_samples", 31, "state\\['num_samples'\\]: saved 31, this sampler has 30"),
        ("seed", 9, "state\\['seed'\\]: saved 9"),
        ("shuffle", False, "state\\['shuffle'\\]"),
        ("version", 7, "state\\['version'\\]"),
        ("position", 31, "position: 31 is past num_samples 30"),
        ("position", -2, "position: must be >= 0"),
    ],
)
def test_a_state_of_another_order_is_refused_and_changes_nothing(key, value, match):
    sampler = ResumableSampler(30, global_batch_size=4, rank=0, world_size=2)
    next(iter(sampler))
    before = sampler.state_dict()
    with pytest.raises(ValueError, match=match):
        sampler.load_state_dict({**before, key: value})
    assert sampler.state_dict() == before
    with pytest.raises(ValueError, match="key 'epoch' is missing"):
        sampler.load_state_dict({k: v for k, v in before.items() if k != "epoch"})
