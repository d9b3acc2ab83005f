"""``dp_mesh_dims`` with spmd_types-annotated parameters, torch's FSDP2 against the door
([Note: dp_mesh_dims on the door]; tests/dist/fsdp2_dp_mesh_cases.py), at 2 ranks on a
1-D mesh and at 4 as (2, 2) HSDP.

Where this torch translates spmd_types annotations (2.14 on), parameters annotated
replicated (``spmd.R``) on every axis train on both bit for bit (2-term sums), and both
refuse a parameter annotated sharded on a data-parallel axis and annotated parameters
without ``dp_mesh_dims``. On torch 2.13 both refuse every case (torch's FSDP2 takes only
DTensor parameters with ``dp_mesh_dims``). The negative control of the training
comparison is torchtitan's, in test_torchtitan_fsdp2.py (gradients averaged instead of
summed differ); each refusal here fails if its check is removed (the door then trains).
"""

from __future__ import annotations

import pytest

from shardwrap.base.torch_compat import fsdp2_translates_spmd_types
from tests.dist import fsdp2_dp_mesh_cases as dm
from tests.dist.harness import run_ranks

TRANSLATES = fsdp2_translates_spmd_types()


@pytest.mark.parametrize(("case", "world_size"), [("fsdp", 2), ("hsdp", 4)])
def test_annotated_replicated_parameters_train_as_on_torch_fsdp2(case, world_size):
    for rank, found in enumerate(run_ranks(dm.compare, world_size, case)):
        if not TRANSLATES:
            assert "all parameters must be DTensors" in found["errors"]["torch"], found
            assert found["errors"]["shardwrap"].startswith(
                "ValueError: dp_mesh_dims: torch before 2.14"
            ), found
            continue
        assert found["errors"] == {"torch": None, "shardwrap": None}, (rank, found)
        assert found["differences"] == [], (rank, found["differences"][:4])


@pytest.mark.parametrize(
    ("case", "theirs", "ours"),
    [
        ("sharded_annotation", "Expected spmd.R on FSDP DP axis", "is annotated"),
        (
            "annotated_without_dims",
            "spmd_types parameters require",
            "carries spmd_types annotations",
        ),
    ],
)
def test_what_torch_fsdp2_refuses_the_door_refuses(case, theirs, ours):
    for found in run_ranks(dm.compare, 2, case):
        errors = found["errors"]
        if not TRANSLATES and case == "annotated_without_dims":  # 2.13 ignores annotations
            assert errors == {"torch": None, "shardwrap": None}, found
            continue
        if not TRANSLATES:
            assert "all parameters must be DTensors" in errors["torch"], found
            continue
        assert theirs in errors["torch"], found
        assert errors["shardwrap"] is not None and ours in errors["shardwrap"], found
