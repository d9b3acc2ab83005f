"""The FSDP2 door: one FSDP2 client script, run with torch's ``fully_shard`` and shardwrap's.

At 2 ranks every gradient sum has two terms, which floating point adds alike in any
order, so the two runs must agree bit for bit: losses, gradient norms (torch's
``clip_grad_norm_`` over the DTensor gradients), every parameter's ``full_tensor()``, local
shapes and placements, and ``model.state_dict()``, after every AdamW step; with gradient
accumulation through ``set_requires_gradient_sync``, and with each block's MLP a list
unit (``fully_shard([up, down])``) too. At 3 ranks gloo's ring
reduce-scatter adds the three terms in an order that depends on the element's position
(checked: some elements match no fixed order of the three), shardwrap in rank order, so
values agree within the bounds of tests/tolerances.py (AdamW with eps = 1e-3 there), and
shapes, placements and keys exactly. The model's uneven rows leave some rank's chunk
short or empty (tests/dist/fsdp2_cases.py).

Mixed precision (``MixedPrecisionPolicy`` per call: bf16, bf16 reducing in fp32, fp32
outputs, bf16 blocks in an fp32 root) is compared the same way at 2 ranks, bit for bit:
both sides compute the same bf16 ops, and a two-term bf16 sum divided by 2 rounds alike.

Negative controls (in the suite): gradients not divided by the world size
(``fc.undivided_fully_shard``), and the policy's ``param_dtype`` ignored
(``fc.fp32_gather_fully_shard``), must fail the same comparison.

``ignored_params`` (the blocks' calls ignore block 0's LayerNorm weight, the root's the
gate) is compared the same way: those parameters stay plain on both sides, with each
rank's own unreduced gradients, so each rank's values differ and must still equal
torch's on that rank. Negative controls: shardwrap dropping ``ignored_params``
(``fc.managing_ignored_fully_shard``, in the suite) fails on placements and values; the
root's call not leaving out what a block's call left out (``_left_out_below`` not
applied, run once) failed from step 0 (grad norm 0.20669076 != 0.20690839, block 0's
LayerNorm weight sharded).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import fsdp2_api_cases as api
from tests.dist import fsdp2_cases as fc
from tests.dist import fsdp2_list_unit_cases as lu
from tests.dist.harness import run_ranks
from tests.tolerances import REORDER_SAFE_ADAMW

EXACT = fc.Script()
ACCUMULATING = fc.Script(microbatches=2)
LISTS = fc.Script(mlp_as_list=True)
LEAD_GAIN = fc.Script(lead_gain=True)
# Negative control (run once): set_gradient_divide_factor a no-op fails it (grad norm).
SUMMED = fc.Script(sum_gradients=True)
# Mixed precision, each call's policy: (param_dtype, reduce_dtype, output_dtype, cast_inputs).
# Negative controls run once (shardwrap's side given an altered policy): reduce_dtype
# dropped fails BF16_FP32_REDUCE on the grad norm; output_dtype dropped fails FP32_OUTPUT
# on the loss and BF16_BLOCKS with a dtype-mismatch error; cast_forward_inputs=False fails
# BF16_BLOCKS (layer_norm: mixed dtype). The param_dtype control stays in the suite.
_BF16 = (torch.bfloat16, None, None, True)
BF16 = fc.Script(mp=_BF16, root_mp=_BF16)
_FP32_REDUCE = (torch.bfloat16, torch.float32, None, True)
BF16_FP32_REDUCE = fc.Script(mp=_FP32_REDUCE, root_mp=_FP32_REDUCE)
FP32_OUTPUT = fc.Script(mp=_BF16, root_mp=(torch.bfloat16, None, torch.float32, True))
# bf16 blocks in an fp32 root: each block casts its fp32 inputs to bf16 and its outputs
# back to fp32 (the root's default policy computes in fp32).
BF16_BLOCKS = fc.Script(mp=(torch.bfloat16, None, torch.float32, True))
# ignored_params on every call: the gate and block 0's LayerNorm weight stay plain
# parameters, unsharded and unreduced (each rank's own gradient, so each rank's values).
IGNORED = fc.Script(ignored=True)
# float16 computing and reducing: FSDP2 divides by 2 before the 2-rank sum and by 1 after
# it; with a divide factor of 3, by 2 before and 1.5 after, in float16. Negative control
# (in the suite): the sum divided once, after the cast (fc.one_division_fully_shard). Both
# fail it at step 0: halving a float16 gradient under float16's normal range drops a bit
# (parameters differ), and the thirds' grad norm too (0.17049144 != 0.17049000).
_FP16 = (torch.float16, torch.float16, None, True)
FP16 = fc.Script(mp=_FP16, root_mp=_FP16)
FP16_THIRDS = fc.Script(mp=_FP16, root_mp=_FP16, divide_factor=3.0)
REORDER_SAFE = fc.Script(adamw=(*REORDER_SAFE_ADAMW.items(), ("weight_decay", 0.1)))

REORDERED = fc.REORDERED  # the bounds of tests/tolerances.py for 3 ranks' sums


@pytest.mark.parametrize(
    "script",
    [
        EXACT,
        ACCUMULATING,
        LISTS,
        SUMMED,
        BF16,
        BF16_FP32_REDUCE,
        FP32_OUTPUT,
        BF16_BLOCKS,
        IGNORED,
        FP16,
        FP16_THIRDS,
    ],
    ids=[
        "adamw",
        "accumulate",
        "list_unit",
        "summed_gradients",
        "bf16",
        "bf16_fp32_reduce",
        "fp32_output",
        "bf16_blocks_in_fp32_root",
        "ignored_params",
        "fp16",
        "fp16_divided_by_3",
    ],
)
def test_two_ranks_equal_torch_fsdp2_bit_for_bit(script):
    for rank, found in enumerate(run_ranks(fc.compare, 2, script, None, None)):
        assert found == [], f"rank {rank}: {found[:8]}"


@pytest.mark.parametrize(
    "script",
    [EXACT, ACCUMULATING, LISTS, LEAD_GAIN],
    ids=["adamw", "accumulate", "list_unit", "padded_chunk_first"],
)
def test_three_ranks_equal_torch_fsdp2_bit_for_bit(script):
    """Three terms: the door adds them in gloo's order ([Note: gloo's sum order]), each
    element in the order of its position in FSDP2's padded chunk (LEAD_GAIN puts padding
    where the order changes; its few elements there happened to sum alike either way, so
    that part's control is tests/dist/test_pairwise.py's). Negative control (in the
    suite): the sums in rank order, as before."""
    for rank, found in enumerate(run_ranks(fc.compare, 3, script, None, None)):
        assert found == [], f"rank {rank}: {found[:8]}"


def test_negative_control_three_ranks_summed_in_rank_order_differ():
    for found in run_ranks(fc.compare, 3, EXACT, None, "rank_order"):
        assert found, "rank order matched torch's gloo order"


@pytest.mark.parametrize("world_size", [2, 3])
def test_negative_control_undivided_gradients_differ(world_size):
    for found in run_ranks(fc.compare, world_size, EXACT, None, "undivided"):
        assert any("grad norm" in line for line in found), found[:8]


@pytest.mark.parametrize("script", [FP16, FP16_THIRDS], ids=["fp16", "fp16_divided_by_3"])
def test_negative_control_fp16_divided_once_after_the_cast_differs(script):
    for found in run_ranks(fc.compare, 2, script, None, "one_division"):
        assert any(line.startswith("step 0:") for line in found), found[:8]


def test_fsdp_module_surface_and_install():
    for found in run_ranks(api.surface, 2):
        assert found["rebound"] and found["restored"] and found["dsd"]
        assert found["isinstance"] == (True, True, True, "FSDPTinyModel")
        assert not found["torch_isinstance_after"]  # torch's own class again
        assert found["sharded"] and found["unsharded"] and found["resharded"]
        assert "call it on the root module" in found["partial_sync"]


@pytest.mark.parametrize(
    ("block_setting", "block_kept"), [(None, False), (True, False), (False, True)]
)
def test_reshard_after_forward_frees_what_it_says(block_setting, block_kept):
    """Negative control: the blocks' False row is the True row with the setting flipped;
    a setting not acted on fails one of them."""
    for found in run_ranks(api.resharding, 2, block_setting):
        assert found["after_forward"] == {"root": True, "block0": block_kept, "block1": block_kept}
        assert not any(found["after_backward"].values())


def test_the_optimizer_step_notes_every_unit_of_the_door():
    """The root's own unit counts too: its shard views became DTensors after its runtime
    started, so the runtime indexes them again (``StepRuntime.index_shard_views``).
    Negative control (run once): without that call the root's count stayed 0."""
    for counts in run_ranks(api.stepped_units, 2):
        assert counts == {"root": 1, "block0": 1, "block1": 1}, counts


def test_negative_control_param_dtype_ignored_differs():
    """Mixed precision's control: shardwrap's run gathering and computing in fp32 (the
    policy's param_dtype dropped, its bf16 reduction kept) must fail the bit-for-bit
    comparison with torch's bf16 run, on the losses first."""
    for found in run_ranks(fc.compare, 2, BF16, None, "fp32_gather"):
        assert any("loss" in line for line in found), found[:8]


def test_negative_control_ignored_params_managed_differs():
    """ignored_params' control: shardwrap's run dropping them (sharded, reduced, DTensors)
    must fail the comparison with torch's run: placements from step 0, values after."""
    for found in run_ranks(fc.compare, 2, IGNORED, None, "ignored_managed"):
        assert any("placements['gate.weight']" in line for line in found), found[:8]
        assert any("full['gate.weight']" in line for line in found), found[:8]


@pytest.mark.parametrize("mode", ["skip", "twice"])
def test_a_list_unit_whose_head_does_not_run_equals_torch_fsdp2(mode):
    """[Note: a list as one unit]: the head of ``fully_shard([norm, head])`` never runs;
    each root forward finishes an open pass and starts afresh, as FSDP2's. Bit for bit
    with torch's FSDP2 over 3 steps, with one forward per backward and with two. Controls
    (run once each): without the fresh start, step 1's norm ran on its shard ("got mixed
    torch.Tensor and DTensor"); without finishing the open pass, the second forward freed
    what the first one's graph saved, and the backward read released storage ("its data
    is not allocated yet"; in torch's test_double_partial_forward_then_backward a rank
    died of SIGSEGV)."""
    for found in run_ranks(lu.both, 2, mode):
        theirs, ours = found["torch"], found["shardwrap"]
        assert "error" not in ours, ours
        assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
        assert all(torch.equal(v, ours["params"][k]) for k, v in theirs["params"].items())


def test_a_list_unit_run_again_in_one_forward_is_refused_by_name():
    """The head called per chunk of the loss: torch's FSDP2 trains it (it gathers the
    group again); the door refuses it at the second call, naming the unit, where it used
    to leave the group half run and fail, or crash, a step later."""
    for found in run_ranks(lu.both, 2, "chunks"):
        assert "error" not in found["torch"] and len(found["torch"]["losses"]) == lu.STEPS
        assert "ran a second time since the root's forward began" in found["shardwrap"]["error"]
