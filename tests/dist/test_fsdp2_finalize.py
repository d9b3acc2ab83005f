"""torch 2.15's manual backward finalization and ``set_keep_unsharded_storage`` on the
FSDP2 door, against torch's FSDP2 running the same script (tests/dist/fsdp2_finalize_cases.py)
at 2 gloo ranks, bit for bit in fp32.

Where this torch's FSDP2 has the methods (2.15 on), each manual step equals torch's run of
the same step: one backward then ``finalize_backward()``; two backwards without gradient
sync, then ``finalize_backward(async_op=True).wait()`` with sync back on; two synchronising
backwards then one ``finalize_backward()`` (the root, which autograd does not reach, is
reduced once, at the finalization), also with the blocks' ``reshard_after_forward=False``;
and manual finalization never finalized. On every
torch, the first two equal torch's FSDP2 ending each step itself (the same gradients, summed
in the same order), and ``set_keep_unsharded_storage(True)`` changes no number while a
block's gathered weight keeps its storage and data pointer from step to step (under torch
2.15's FSDP2 too).

Negative controls (in the suite): manual finalization never finalized differs from the
finalized run (the root's gradients are never reduced); the end-of-backward callback
reducing the root at every backward (the mode ignored there) differs from torch's two
synchronising backwards (seen: the root's ``norm.bias`` and ``head.weight`` from step 0);
without ``set_keep_unsharded_storage`` (the same run but for the flag) the gathered
weight's storage is freed after every step (0 bytes), so the storage check tells the flag
acted on from not; and the flag keeps every parameter all-gather (as many on the door's
ledger with it as without: FSDP2 skips only the freeing; a kept buffer that skipped the
next gather, seen once in review, had one fewer per step).
"""

from __future__ import annotations

import functools

import pytest
from torch.distributed import fsdp as torch_fsdp

from tests.dist import fsdp2_finalize_cases as fz
from tests.dist.fsdp2_cases import NUM_STEPS
from tests.dist.harness import run_ranks

# torch's FSDP2 finalizes manually from 2.15 on; the door offers it on every release.
TORCH_HAS_MANUAL = hasattr(torch_fsdp.FSDPModule, "finalize_backward")
needs_torch_manual = pytest.mark.skipif(
    not TORCH_HAS_MANUAL, reason="this torch's FSDP2 has no manual backward finalization"
)

MANUAL_STEPS = ["single_finalized", "accumulated_finalized", "synced_finalized", "never_finalized"]
# (torch's automatic step, the door's manual one that must equal it)
AUTOMATIC_EQUIVALENTS = [("single", "single_finalized"), ("accumulated", "accumulated_finalized")]


def _pairs() -> dict[str, tuple]:
    """Every comparison this torch can make, by name: (reference run, our run)."""
    pairs = {
        f"automatic {manual}": (("torch", auto, False), ("shardwrap", manual, False))
        for auto, manual in AUTOMATIC_EQUIVALENTS
    }
    pairs["never finalized"] = (("torch", "single", False), ("shardwrap", "never_finalized", False))
    torch_keeps = TORCH_HAS_MANUAL  # set_keep_unsharded_storage came with 2.15 too
    pairs["keep"] = (("torch", "single", torch_keeps), ("shardwrap", "single", True))
    # The control: the same run but for the flag.
    pairs["keep control"] = (("shardwrap", "single", False), ("shardwrap", "single", True))
    if TORCH_HAS_MANUAL:
        for step in MANUAL_STEPS:
            pairs[f"torch {step}"] = (("torch", step, False), ("shardwrap", step, False))
        kept = ("synced_finalized", False, False)  # the blocks kept gathered after forward
        pairs["torch blocks kept gathered"] = (("torch", *kept), ("shardwrap", *kept))
        pairs["undeferred"] = (
            ("torch", "synced_finalized", False),
            ("undeferred", "synced_finalized", False),
        )
    return pairs


@functools.cache
def _runs() -> dict[str, list[dict]]:
    """Each comparison's result on every rank, run once for the module."""
    pairs = _pairs()
    by_rank = run_ranks(fz.compare, 2, list(pairs.values()))
    return {name: [found[i] for found in by_rank] for i, name in enumerate(pairs)}


@needs_torch_manual
@pytest.mark.parametrize("case", [*MANUAL_STEPS, "blocks kept gathered"])
def test_manual_finalization_equals_torch_fsdp2s(case):
    """Each manual step (and two syncing backwards with the blocks'
    ``reshard_after_forward=False``) equals torch's FSDP2 bit for bit."""
    for rank, found in enumerate(_runs()[f"torch {case}"]):
        assert found.get("differences") == [], f"rank {rank}: {found}"


@needs_torch_manual
def test_negative_control_the_root_reduced_at_every_backward_differs_from_torch():
    for found in _runs()["undeferred"]:
        assert found["differences"] != [], found
        first = [line for line in found["differences"] if line.startswith("step 0:")]
        assert first and not any("blocks." in line for line in first), found


@pytest.mark.parametrize(("automatic", "manual"), AUTOMATIC_EQUIVALENTS)
def test_manual_finalization_equals_torch_fsdp2_ending_each_step_itself(automatic, manual):
    for rank, found in enumerate(_runs()[f"automatic {manual}"]):
        assert found.get("differences") == [], f"rank {rank}: {found}"


def test_negative_control_never_finalizing_leaves_gradients_unreduced():
    for found in _runs()["never finalized"]:
        assert any("grad norm" in line for line in found["differences"]), found


def _kept(storage: dict) -> bool:
    """The gathered weight held storage after every step, always at one address."""
    return all(storage["sizes"]) and len(set(storage["pointers"])) == 1


def test_kept_unsharded_storage_changes_no_number_and_keeps_its_address():
    for rank, found in enumerate(_runs()["keep"]):
        assert found.get("differences") == [], f"rank {rank}: {found}"
        assert len(found["storage"]["ours"]["sizes"]) == NUM_STEPS
        assert _kept(found["storage"]["ours"]), found["storage"]
        assert _kept(found["storage"]["reference"]) == TORCH_HAS_MANUAL, found["storage"]


def test_negative_control_without_keeping_the_storage_is_freed_every_step():
    """The same run without the flag: the storage freed after every step; and the flag
    keeps every all-gather, as FSDP2's (it skips only the freeing): the door's ledger holds
    as many parameter gathers with it as without."""
    for found in _runs()["keep control"]:
        assert found.get("differences") == [], found
        without, kept = found["storage"]["reference"], found["storage"]["ours"]
        assert without["sizes"] == [0] * NUM_STEPS, without
        assert _kept(kept), kept
        assert kept["gathers"] == without["gathers"] > 0, (kept, without)
    for found in _runs()["automatic single_finalized"]:
        for storage in found["storage"].values():
            assert storage["sizes"] == [0] * NUM_STEPS, storage


# FSDP2's own errors (torch 2.15's messages), and what it accepts.
MISUSE = {
    "before_forward": "accepted",
    "on_a_block": "RuntimeError: set_manual_backward_finalization must be called on the root "
    "FSDP module",
    "without_the_mode": "RuntimeError: FSDP finalize_backward requires manual backward "
    "finalization. Call set_manual_backward_finalization(True) before forward",
    "mode_changed_mid_step": "RuntimeError: set_manual_backward_finalization cannot change "
    "mode after backward starts",
    "forward_before_wait": "RuntimeError: The previous gradient reduction must be waited on "
    "before forward",
    "finalize_before_wait": "RuntimeError: The previous gradient reduction must be waited on "
    "before finalizing backward again",
    "twice": "accepted",
    "during_backward": "RuntimeError: FSDP finalize_backward must be called after backward "
    "completes",
    "set_during_backward": "RuntimeError: set_manual_backward_finalization cannot change "
    "mode during backward",
    "off_the_root": "RuntimeError: finalize_backward must be called on the root FSDP module",
    "handle_after_reset": "RuntimeError: This gradient reduction handle was invalidated",
}


# The door's own: a type check, and the setting refused when a later call adopts the root
# it was set on (FSDP2 raises at the first forward).
DOOR_ONLY = {
    "enabled_not_bool": "TypeError: enabled: expected a bool, got 1",
    "set_on_a_root_adopted_later": "RuntimeError: set_manual_backward_finalization must be "
    "called on the root FSDP module",
}


def test_misuse_gets_fsdp2s_errors():
    for found in run_ranks(fz.misuse, 2, "shardwrap"):
        assert found == {**MISUSE, **DOOR_ONLY}


@needs_torch_manual
def test_the_misuse_table_is_torch_fsdp2s():
    for found in run_ranks(fz.misuse, 2, "torch"):
        assert found == MISUSE


# torch 2.15's words; the door's own where torch has none.
HSDP_PARTIAL = (
    "RuntimeError: FSDP manual backward finalization does not support partial gradient "
    "reductions for parameter group 'blocks.0'. Use automatic backward finalization for "
    "this configuration"
)


def test_manual_finalization_refuses_kept_hsdp_sums_as_fsdp2_does():
    """4 ranks as (2, 2): with the all-reduce skipped the blocks hold partial sums, which
    finalize_backward refuses (torch 2.15's message, compared where torch has it). Control
    (run once): without the kept-partial check the door raised its other refusal instead
    ("requires all-reduce for parameter group '<root>'", the root waiting unreduced)."""
    sides = ["shardwrap", "torch"] if TORCH_HAS_MANUAL else ["shardwrap"]
    for side in sides:
        for found in run_ranks(fz.hsdp_partial, 4, side):
            assert found == HSDP_PARTIAL, (side, found)
