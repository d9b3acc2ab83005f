"""torchtitan's own FSDP2 code runs shardwrap after ``shardwrap.install()``, unchanged, and
equals torch's FSDP2 bit for bit (tests/dist/torchtitan_cases.py).

torchtitan's llama3 (a tiny config built the way its ``debugmodel`` flavor is) on the meta
device, ``parallelize_llama`` with ``ParallelDims(dp_shard=2)`` as its ``Trainer`` calls it
(``apply_fsdp_to_decoder``: ``fully_shard`` on the embedding, on ``[norm, lm_head]`` as one
list unit, on each block and on the root; then ``set_gradient_divide_factor(1.0)`` on every
module that is a ``torch.distributed._composable.fsdp.FSDPModule``, since torchtitan
divides the summed loss by the global token count itself), ``to_empty`` and
``init_weights`` on the sharded DTensor parameters, then 3 steps on each rank's own tokens
(torchtitan's ``clip_grad_norm_`` on the DTensor gradients, AdamW), at 2 gloo ranks in
fp32. Run on torch's ``fully_shard`` and, in the same processes, on shardwrap's: every
loss and gradient norm on every rank and every parameter's ``full_tensor()`` at the end
are equal bit for bit (each gradient sum has two terms). The
door really ran: torchtitan's six units are shardwrap ``FSDPModule`` instances and the
root's ledger holds the parameter all-gathers and gradient reduce-scatters.

torchtitan's two data-parallel backends: ``spmd_backend="partial_dtensor"`` (FSDP over
the 1-D ``fsdp`` mesh) and its default, ``"spmd_types"``: parameters annotated with
spmd_types local types (replicated on the ``dp_shard`` axis), ``fully_shard`` given the
named storage mesh and ``dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")``, which
torch 2.14 and later translate into DTensors ([Note: dp_mesh_dims on the door]). On torch
2.13 torch's own ``fully_shard`` refuses those parameters ("When dp_mesh_dims is provided,
all parameters must be DTensors on the full SPMD mesh"), and the door refuses them too,
naming ``dp_mesh_dims`` and the backend to use.

Negative controls. In the suite: ``install()`` with torch's ``FSDPModule`` left in
``torch.distributed._composable.fsdp`` (where torchtitan's check reads it), so the
divide factor is never set on shardwrap's units and gradients are averaged, must differ
from torch's. It does: step 0's loss agrees and its gradient norm is exactly half of
torch's (0.5094432 against 1.0188864, so torchtitan's clipping to 1.0 no longer scales
it); the losses part from step 1 on rank 1 (2.8231359 against 2.8231368) and step 2 on
rank 0 (2.9563811 against 2.9563804), and all 17 parameters differ (by up to 1.7e-4).
Run once: shardwrap's ``set_gradient_divide_factor`` made a no-op fails the main
comparison: its losses (from step 2 on rank 0), gradient norms and parameters
(tok_embeddings.weight first) differ from torch's.
"""

from __future__ import annotations

import torch
import torchtitan  # noqa: F401 (a declared test dependency: a broken install fails, never skips)

from shardwrap.base.torch_compat import fsdp2_translates_spmd_types
from tests.dist import torchtitan_cases as tc
from tests.dist.harness import run_ranks

# torchtitan's units: the embedding and [norm, lm_head] (or, tied, [tok_embeddings, norm,
# lm_head] as one unit), each block, the root.
NUM_FSDP_MODULES = 1 + 2 + tc.NUM_LAYERS + 1


def differences(reference: dict, ours: dict) -> list[str]:
    found = [
        f"{key} {reference[key]} != {ours[key]}"
        for key in ("losses", "grad_norms")
        if reference[key] != ours[key]
    ]
    if reference["params"].keys() != ours["params"].keys():
        return [*found, f"parameters {sorted(reference['params'])} != {sorted(ours['params'])}"]
    return found + [
        f"parameter {name} differs"
        for name, value in reference["params"].items()
        if not torch.equal(value, ours["params"][name])
    ]


def door_checks(rank: int, torch_run: dict, ours: dict) -> None:
    """That each run was on the door it names, shardwrap's with its collectives."""
    assert torch_run["fsdp_modules"] == ["torch.distributed.fsdp._fully_shard._fsdp_init"]
    assert torch_run["num_shardwrap_modules"] == 0, rank
    assert ours["fsdp_modules"] == ["shardwrap.fsdp2.module"], (rank, ours["fsdp_modules"])
    assert ours["num_shardwrap_modules"] == NUM_FSDP_MODULES, rank
    moved = set(ours["collectives"])  # (kind, purpose) in the root's ledger
    assert {("all_gather", "params"), ("reduce_scatter", "grads")} <= moved, (rank, moved)
    assert len(torch_run["losses"]) == tc.STEPS and torch_run["params"], rank


def check_with_control(spmd_backend: str) -> None:
    """torchtitan on both doors equal bit for bit, and the control apart (module doc)."""
    doors = ("torch", "shardwrap", "shardwrap_without_composable")
    for rank, out in enumerate(run_ranks(tc.runs, 2, doors, spmd_backend, False)):
        torch_run, ours, control = (out[door] for door in doors)
        door_checks(rank, torch_run, ours)
        found = differences(torch_run, ours)
        assert found == [], (rank, found[:4])
        # The negative control: the same first loss, gradients averaged instead of summed
        # (half the norm, exactly: 2 ranks), then losses and every parameter apart.
        assert control["num_shardwrap_modules"] == NUM_FSDP_MODULES, rank
        assert control["losses"][0] == torch_run["losses"][0], rank
        assert control["grad_norms"][0] == torch_run["grad_norms"][0] / 2, rank
        assert len(differences(torch_run, control)) == 2 + len(torch_run["params"]), rank


def test_torchtitan_fsdp2_on_shardwrap_equals_torch_fsdp2_bit_for_bit() -> None:
    check_with_control("partial_dtensor")


def test_torchtitan_fsdp2_on_three_ranks_equals_torch_fsdp2_bit_for_bit() -> None:
    """Three terms per gradient sum, added in gloo's order ([Note: gloo's sum order]).
    Negative control (run once): the door's sums in rank order, as before that note:
    12 or 13 differences per rank."""
    doors = ("torch", "shardwrap")
    for rank, out in enumerate(run_ranks(tc.runs, 3, doors, "partial_dtensor", False)):
        door_checks(rank, out["torch"], out["shardwrap"])
        found = differences(out["torch"], out["shardwrap"])
        assert found == [], (rank, found[:4])


def test_torchtitan_tied_embeddings_on_shardwrap_equal_torch_fsdp2_bit_for_bit() -> None:
    """Weight tying (torchtitan's 1B and 3B flavors): the embedding, the final norm and the
    output projection, which share a weight, are one list unit."""
    doors = ("torch", "shardwrap")
    for rank, out in enumerate(run_ranks(tc.runs, 2, doors, "partial_dtensor", True)):
        torch_run, ours = out["torch"], out["shardwrap"]
        door_checks(rank, torch_run, ours)
        assert "lm_head.weight" not in torch_run["params"], sorted(torch_run["params"])
        found = differences(torch_run, ours)
        assert found == [], (rank, found[:4])


def test_torchtitan_default_spmd_types_backend_as_torch_fsdp2_takes_it() -> None:
    """torchtitan's default backend (``dp_mesh_dims``): on torch 2.14 and later, trained on
    both doors bit for bit, with the control apart; on 2.13 refused by both."""
    if fsdp2_translates_spmd_types():
        check_with_control("spmd_types")
        return
    for rank, found in enumerate(run_ranks(tc.refusals, 2, "spmd_types")):
        assert "all parameters must be DTensors" in found["torch"], (rank, found["torch"])
        ours = found["shardwrap"]
        assert ours.startswith("ValueError: dp_mesh_dims: torch before 2.14"), (rank, ours)
        assert "spmd_backend='partial_dtensor'" in ours, (rank, ours)
