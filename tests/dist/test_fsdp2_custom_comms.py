"""``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` on the FSDP2 door,
against torch's FSDP2 running the same script (tests/dist/fsdp2_cases.py) with the same
user communicators: a recording object per kind on every ``fully_shard`` call, which
delegates to ``torch.distributed``'s all-gather / reduce-scatter and counts its calls,
its ``allocate`` calls and the tensors it was handed.

At 2 gloo ranks, in fp32, bf16 gathers with fp32 reductions, fp16, and under
CPUOffloadPolicy: every number
equals torch's bit for bit; each step calls the objects as often (5 gathers: the root
once, each block in forward and in backward; 3 reduce-scatters), with tensors of the
same sizes and dtypes, and ``allocate`` as often (one buffer per gather, two per
reduce-scatter). The op differs: FSDP2 passes ``AVG`` for fp32/bf16, shardwrap always
``SUM`` and divides itself ([Note: user communicators] in shardwrap/comm/user_comms.py).
The ledger still records each collective with the full buffer's bytes (control run
once: ``Communicator.run_user`` not recording leaves the ledger without them). HSDP (4 ranks, a
(2, 2) mesh, microbatches that skip the replica all-reduce or the sync) equals torch's
bit for bit too, with the same calls.

Negative controls (in the suite): a gather object that zeroes what it gathered changes
the first loss, and a reduce-scatter object that negates its output changes the
parameters after the first step (a doubled output would not: AdamW and clipping to a
norm undo a scale), so the objects are the collectives shardwrap uses.
"""

from __future__ import annotations

import functools

import pytest

from tests.dist import fsdp2_custom_comms_cases as cc
from tests.dist.fsdp2_cases import NUM_STEPS
from tests.dist.harness import run_ranks


@functools.cache
def _runs(script: str) -> list[dict]:
    return run_ranks(cc.custom_comms, 2, script, script == "fp32")


@pytest.mark.parametrize("script", list(cc.SCRIPTS))
def test_user_communicators_equal_torch_fsdp2_with_the_same_calls(script):
    for rank, found in enumerate(_runs(script)):
        ours, theirs = found["ours"], found["torch"]
        assert ours["differences"] == [], f"rank {rank}: {ours['differences'][:8]}"
        assert theirs["calls_per_step"] == [(5, 3)] * NUM_STEPS, theirs
        for key in ("calls_per_step", "allocations", "gather_seen"):
            assert ours[key] == theirs[key], (key, ours[key], theirs[key])
        # the same sizes and dtypes; the op: SUM here, FSDP2's own choice there
        assert {k[:3]: n for k, n in ours["reduce_seen"].items()} == {
            k[:3]: n for k, n in theirs["reduce_seen"].items()
        }
        assert {k[3] for k in ours["reduce_seen"]} == {"RedOpType.SUM"}
        # async_op: always True here (the engine waits on the Work); FSDP2 passes False to
        # a gather outside unshard(async_op=True) and none to a reduce-scatter (the default)
        assert ours["async_ops"] == ({True}, {True}), ours["async_ops"]
        assert theirs["async_ops"] == ({False}, {False}), theirs["async_ops"]


@pytest.mark.parametrize("script", list(cc.SCRIPTS))
def test_the_ledger_still_counts_every_user_collective_with_its_bytes(script):
    for found in _runs(script):
        ours = found["ours"]
        ledger = ours["ledger"]
        gathers = {b: n for (kind, purpose, b), n in ledger.items() if kind == "all_gather"}
        reduces = {b: n for (kind, purpose, b), n in ledger.items() if kind == "reduce_scatter"}
        itemsize = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}
        expected_gathers = {
            out * itemsize[d]: n for (_, out, d, _), n in ours["gather_seen"].items()
        }
        expected_reduces = {
            inp * itemsize[d]: n for (inp, _, d, _), n in ours["reduce_seen"].items()
        }
        assert gathers == expected_gathers and reduces == expected_reduces, ledger


def test_negative_control_a_zeroing_gather_changes_the_first_loss():
    for found in _runs("fp32"):
        control = found["zeroed_gather"]
        assert control["differences"][0].startswith("step 0: loss"), control["differences"][:4]


def test_negative_control_a_negating_reduce_scatter_changes_the_parameters():
    for found in _runs("fp32"):
        control = found["negated_reduce"]
        assert any("step 0: full[" in d for d in control["differences"]), control["differences"]


def test_user_communicators_under_hsdp_equal_torch_fsdp2_with_the_same_calls():
    for rank, found in enumerate(run_ranks(cc.hsdp_custom_comms, 4)):
        ours, theirs = found.pop("ours"), found["torch"]
        assert ours.pop("differences") == [], f"rank {rank}"
        assert ours == theirs and theirs["calls"][1] > 0, (ours, theirs)


@pytest.mark.parametrize("method", ["set_custom_all_gather", "set_custom_reduce_scatter"])
@pytest.mark.parametrize("comm", [print, 3, None], ids=["no_allocate", "int", "none"])
def test_an_object_without_the_protocol_is_refused_by_name(method, comm):
    for message in run_ranks(cc.refused_comm, 2, method, comm):
        assert message.startswith("TypeError: comm: expected a communicator object"), message


def test_where_a_unit_cannot_use_the_object_it_is_refused_by_name():
    """A unit resharded to pairs after forward (reshard_after_forward=2 at 4 ranks) gathers
    backward's parameters from its kept slice over the pair, so the gather object is
    refused there; its reduce-scatter is the plain one and is accepted (the control)."""
    for found in run_ranks(cc.refused_units, 4):
        gather = found["reshard_int", "set_custom_all_gather"]
        assert gather.startswith("FSDPModule.set_custom_all_gather is not yet supported"), gather
        assert "reshard_after_forward is an int" in gather
        assert found["reshard_int", "set_custom_reduce_scatter"] == "accepted"


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gather_object_is_handed_fsdp2s_sizes_and_values_in_the_doors_order(world_size):
    """What the docs say it gets: the same buffer sizes and values as under FSDP2 and rank
    0's part in FSDP2's order; the other ranks' parts differ in order (the padding at the
    shard's end, not after each short chunk), which the whole-buffer comparison shows."""
    for found in run_ranks(cc.gathered_outputs, world_size):
        expected = {"sizes": True, "rank_0_part": True, "whole": False, "values": True}
        assert found == [expected] * 3, found
