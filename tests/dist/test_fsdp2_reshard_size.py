"""The FSDP2 door's ``reshard_after_forward`` as an int: reshard to a smaller group.

The script of tests/dist/fsdp2_cases.py runs at 4 gloo ranks with every block's call
given ``reshard_after_forward=2``, under torch's ``fully_shard`` and shardwrap's, compared
bit for bit (losses, gradient norms, every parameter's ``full_tensor()``, local shapes,
placements, ``state_dict()``): shapes and placements exactly, values within the
reordering bounds of tests/tolerances.py (gloo's 4-term reduce-scatter sums in another
order than shardwrap's; AdamW with eps = 1e-3, as the door's 3-rank test). An all-gather's values
do not depend on its group, so the
numbers are equal whether or not the groups are honoured; what an int changes is where
backward gathers: torch's FSDP2 gathers a block in backward inside its pair of ranks, and
so must shardwrap's (its ledger: block gathers at group sizes 4, forward, and 2,
backward).

Negative control (in the suite): the int handed on as True. The numbers stay equal, and
the group-size check fails: every block gather runs at 4.
"""

from __future__ import annotations

import functools

from tests.dist import fsdp2_reshard_cases as rc
from tests.dist.harness import run_ranks

WORLD = 4


@functools.cache
def _runs() -> list[dict]:
    """Every rank's comparison of shardwrap's run and the control's with torch's (one
    harness call for both tests)."""
    return run_ranks(rc.compare, WORLD)


def test_reshard_to_pairs_equals_torch_fsdp2_and_gathers_inside_the_pair():
    for rank, found in enumerate(_runs()):
        ours = found["ours"]
        assert ours["differences"] == [], f"rank {rank}: {ours['differences'][:8]}"
        assert ours["sizes"] == {"blocks.0": {4, 2}, "blocks.1": {4, 2}, "(root)": {4}}, ours


def test_negative_control_the_int_as_true_gathers_at_the_whole_group():
    for found in _runs():
        control = found["control"]
        assert control["differences"] == [], control["differences"][:8]
        assert control["sizes"] == {"blocks.0": {4}, "blocks.1": {4}, "(root)": {4}}, control


def test_sizes_torch_refuses_or_warns_about_are_refused_or_warned_about():
    for found in run_ranks(rc.edge_sizes, WORLD):
        for name in ("torch", "shardwrap"):
            assert "factor of 4" in found[f"{name} 3"], found
        assert "reshard_after_forward=3" in found["shardwrap 3"], found
        assert found["warned"] and found["keeps"] is False, found
