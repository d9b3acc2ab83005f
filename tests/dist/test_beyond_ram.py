"""Under DiskOffload a rank holds resident only what it is using of state several times that.

Two measures. The residency test counts the resident pages of the offloaded state itself
(the store's mapped files) through forward, backward, clipping and the optimizer step; see
[Note: measuring what is resident of the offloaded state] in tests/dist/residency_cases.py.
The ceiling test bounds the rest, the rank's private memory (RLIMIT_DATA, which does not
count shared file mappings: it cannot see the offloaded state); see [Note: a memory
ceiling on a rank] in tests/dist/ceiling_cases.py. The full-size run (2.5B parameters on
this machine) is benchmarks/bench_beyond_ram.py.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.dist import ceiling_cases, residency_cases
from tests.dist.harness import run_ranks

# Pages are released (and counted, from /proc) on Linux only.
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="page releases are Linux-only")


@linux_only
def test_disk_offload_keeps_only_the_unit_in_flight_resident(tmp_path) -> None:
    """Per phase, the peak of the offloaded state's resident bytes is within its bound."""
    results = run_ranks(residency_cases.both_configs, 2, str(tmp_path))
    for rank, by_config in enumerate(results):
        for config, result in by_config.items():
            where = (rank, config, result)
            # The state is many times the largest bound (shards and Adam state alone).
            assert result["mapped"] >= 3 * residency_cases.NUM_UNITS * residency_cases.UNIT_BYTES
            assert set(result["peaks"]) == residency_cases.phases(config), where
            assert residency_cases.over_bound(result["peaks"], config) == {}, where
            # The count is the kernel's, and sees pages: everything read is resident.
            assert result["counted"] == result["smaps"] >= result["mapped"], where
    assert os.listdir(tmp_path) == [], "the scratch directories are removed at exit"


@linux_only
@pytest.mark.parametrize("site", sorted(residency_cases.RELEASE_SITES))
def test_residency_fails_without_each_page_release(tmp_path, site: str) -> None:
    """Negative control: the site's page release made a no-op breaks its phase's bound."""
    _, _, config, phase = residency_cases.RELEASE_SITES[site]
    results = run_ranks(residency_cases.residency_without, 2, str(tmp_path), site)
    for rank, result in enumerate(results):
        over = residency_cases.over_bound(result["peaks"], config)
        assert phase in over, (rank, site, result["peaks"])


@linux_only
def test_residency_fails_with_releases_not_widened_to_fault_around(tmp_path) -> None:
    """Negative control: page-exact releases leave, between sub-groups, what the next one's
    read faults mapped of the last ([Note: fault-around] in shardwrap/base/pages.py)."""
    results = run_ranks(residency_cases.residency_with_page_exact_releases, 2, str(tmp_path))
    for rank, result in enumerate(results):
        over = residency_cases.over_bound(result["peaks"], "streamed")
        assert "sub-group" in over, (rank, result)


def test_disk_offload_trains_a_model_several_times_the_ceiling(tmp_path) -> None:
    """Private memory (not the offloaded state: see the module docstring) stays under a
    ceiling the same model trained in memory meets; disk and memory train bit for bit alike."""
    # New interpreters: the ceiling and the malloc settings must not reach the shared
    # pool, and the scratch folders go at interpreter exit, which a forked rank skips.
    results = run_ranks(ceiling_cases.trains_beyond_the_ceiling, 2, str(tmp_path), spawned=True)
    for rank, result in enumerate(results):
        assert result["state_bytes"] >= 3 * ceiling_cases.CEILING_HEADROOM, (rank, result)
    # The same model in memory meets the ceiling (and says so, rather than swapping): on
    # every rank, or on one first, whose end the other then sees in a collective.
    failures = [ceiling_cases.InMemory(result["failure"]) for result in results]
    assert ceiling_cases.InMemory.OUT_OF_MEMORY in failures, f"it fit the ceiling: {results}"
    assert ceiling_cases.InMemory.FIT not in failures, results
    assert os.listdir(tmp_path) == [], "the scratch directories are removed at exit"
