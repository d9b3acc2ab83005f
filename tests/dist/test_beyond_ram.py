"""A model whose state is several times a memory ceiling on each rank trains under DiskOffload.

See [Note: a memory ceiling on a rank] in tests/dist/ceiling_cases.py; the full-size run
(2.5B parameters on this machine) is benchmarks/bench_beyond_ram.py.
"""

from __future__ import annotations

import os

from tests.dist import ceiling_cases
from tests.dist.harness import run_ranks


def test_disk_offload_trains_a_model_several_times_the_ceiling(tmp_path) -> None:
    # Fresh ranks: the ceiling and the malloc settings must not reach the shared pool.
    results = run_ranks(ceiling_cases.trains_beyond_the_ceiling, 2, str(tmp_path), fresh=True)
    for rank, result in enumerate(results):
        assert result["state_bytes"] >= 6 * ceiling_cases.CEILING_HEADROOM, (rank, result)
        # The same model in memory meets the ceiling (and says so, rather than swapping).
        assert result["failure"] is not None, f"rank {rank}: training in memory fit the ceiling"
        assert "can't allocate memory" in result["failure"] or "MemoryError" in result["failure"]
    assert os.listdir(tmp_path) == [], "the scratch directories are removed at exit"
