"""``balanced_partition``: contiguous, non-empty stages with the smallest largest stage."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwrap.deepspeed.pipe_module import balanced_partition


def _brute_force_best(weights: list[int], parts: int) -> int:
    """The smallest possible largest part over every split into ``parts`` non-empty runs."""
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), parts - 1):
        bounds = [0, *cuts, len(weights)]
        largest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = largest if best is None else min(best, largest)
    return best


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_partition_is_optimal_and_well_formed(data):
    weights = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=9))
    parts = data.draw(st.integers(1, len(weights)))
    bounds = balanced_partition(weights, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == len(weights)
    assert all(a < b for a, b in itertools.pairwise(bounds))  # contiguous, non-empty
    largest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
    assert largest == _brute_force_best(weights, parts)


def test_examples():
    assert balanced_partition([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_partition([10, 0, 10, 0, 10], 3) == [0, 2, 4, 5]
    assert balanced_partition([5], 1) == [0, 1]


@pytest.mark.parametrize(("weights", "parts"), [([1, 2], 3), ([1], 0), ([1, -1], 1)])
def test_bad_input(weights, parts):
    with pytest.raises(ValueError, match="num_stages|weights"):
        balanced_partition(weights, parts)
