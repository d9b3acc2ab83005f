"""``fully_shard``'s int ``reshard_after_forward`` settled against the shard mesh's size
(``fsdp2/fully_shard_args.resolve_reshard_size``), without a process group."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from shardwrap.fsdp2.fully_shard_args import UnitOptions, parse_options, resolve_reshard_size


def _options(reshard_after_forward) -> UnitOptions:
    return parse_options(
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=None,
        mp_policy=MixedPrecisionPolicy(),
        offload_policy=OffloadPolicy(),
        ignored_params=None,
    )


@pytest.mark.parametrize(
    ("given", "shard_size", "reshard", "group"),
    [(2, 4, True, 2), (4, 4, True, None), (2, 8, True, 2), (4, 8, True, 4), (True, 4, True, None),
     (False, 4, False, None), (None, 4, None, None)],
)  # fmt: skip
def test_an_int_becomes_resharding_to_groups_of_that_size(given, shard_size, reshard, group):
    options = resolve_reshard_size(_options(given), shard_size)
    assert options.reshard_after_forward is reshard
    assert options.reshard_group_size == group


def test_one_means_no_resharding_and_warns():
    with pytest.warns(UserWarning, match="reshard_after_forward=1"):
        options = resolve_reshard_size(_options(1), 4)
    assert options.reshard_after_forward is False and options.reshard_group_size is None


@pytest.mark.parametrize("given", [0, 3, 8, -2])
def test_a_size_that_does_not_divide_the_shard_mesh_is_refused(given):
    with pytest.raises(ValueError, match=f"reshard_after_forward={given}: .*factor of 4"):
        resolve_reshard_size(_options(given), 4)


def test_a_non_int_is_refused_naming_the_argument():
    with pytest.raises(TypeError, match="reshard_after_forward"):
        _options(2.0)
