"""FSDPModule's step-level knobs on the FSDP2 door, each against torch's FSDP2 running the
same script (tests/dist/fsdp2_cases.py) at 2 gloo ranks, bit for bit in fp32.

``set_unshard_in_backward(False)`` on the embedding (a unit of its own: its backward needs
only the table's shape): torch's FSDP2 skips its all-gather in backward, and so must
shardwrap (the ledger: one gather per step, at forward), with every number equal.
Negative control (in the suite): the method a no-op. The numbers stay equal (a gather
changes no value) and the ledger shows the embedding gathered twice per step.

``set_post_optim_event(event)`` after every optimizer step: the next forward waits for
the event before its first all-gather and drops it, so each event is waited for once and
then let go. torch's FSDP2 on CPU makes its CPU streams wait on it (a no-op: the event's
own ``wait`` is never called) and drops it at the next root forward; the last step's
event, with no forward after it, is held by both. Negative control (in the suite): the
method a no-op: the events are never waited for (and never held).

``reset_iter_state()`` after a pass that failed in forward or backward, and forwards under
``torch.no_grad()`` (the root kept gathered): each test's own docstring says what it
compares and what its negative control showed.
"""

from __future__ import annotations

import functools

import pytest

from tests.dist import fsdp2_methods_cases as mc
from tests.dist.fsdp2_cases import NUM_STEPS
from tests.dist.harness import run_ranks


@functools.cache
def _unshard_runs() -> list[dict]:
    return run_ranks(mc.unshard_in_backward, 2)


def test_a_unit_not_unsharded_in_backward_equals_torch_fsdp2_without_its_backward_gather():
    for rank, found in enumerate(_unshard_runs()):
        ours = found["ours"]
        assert ours["differences"] == [], f"rank {rank}: {ours['differences'][:8]}"
        assert ours["gathers"]["embed"] == NUM_STEPS, ours["gathers"]


def test_negative_control_the_flag_ignored_gathers_the_embedding_in_backward_too():
    for found in _unshard_runs():
        control, ours = found["control"], found["ours"]
        assert control["differences"] == [], control["differences"][:8]
        assert control["gathers"]["embed"] == 2 * NUM_STEPS, control["gathers"]
        others = {u: n for u, n in control["gathers"].items() if u != "embed"}
        assert others == {u: n for u, n in ours["gathers"].items() if u != "embed"}


@functools.cache
def _event_runs() -> list[dict]:
    return run_ranks(mc.post_optim_event, 2)


def test_the_post_optimizer_event_is_waited_for_before_the_next_gather_then_dropped():
    for rank, found in enumerate(_event_runs()):
        ours = found["ours"]
        assert ours["differences"] == [], f"rank {rank}: {ours['differences'][:8]}"
        *forwarded, last = ours["events"]
        assert len(forwarded) == NUM_STEPS - 1, ours
        for event in forwarded:  # once, with no gather between the step and the wait
            assert event["waits"] == [event["set_at"]] and not event["held"], ours
        assert last["waits"] == [] and last["held"], ours
        # torch's FSDP2 drops each one at the next root forward too, never calling it
        held = [event["held"] for event in found["torch"]["events"]]
        assert held == [False] * (NUM_STEPS - 1) + [True], found["torch"]
        assert all(event["waits"] == [] for event in found["torch"]["events"])


def test_negative_control_the_event_ignored_is_never_waited_for():
    for found in _event_runs():
        control = found["control"]
        assert control["differences"] == [], control["differences"][:8]
        assert all(e["waits"] == [] and not e["held"] for e in control["events"]), control


def test_an_event_of_another_type_is_refused_by_name():
    for message in run_ranks(mc.refused_event, 2):
        assert message.startswith("event: expected a torch.Event"), message


@pytest.mark.parametrize(
    "script", [mc.FAILED_FORWARD, mc.FAILED_BACKWARD], ids=["forward", "backward"]
)
def test_reset_iter_state_after_a_failed_pass_equals_torch_fsdp2(script):
    """Step 1 first runs a pass that raises in block 0's forward, or in its backward after
    block 1's, then ``reset_iter_state()`` and ``zero_grad()``; every step after equals
    torch's FSDP2 bit for bit: before torch 2.15 the failed backward's unreduced local
    gradients (the root's) are carried into the retried one on both sides, from 2.15 both
    drop them ([Note: a step abandoned by an exception]). Negative controls: the method a
    no-op (in the suite) fails the backward case (the end of backward never runs again,
    so no parameter gets a gradient); the forward case passes without it (the next
    forward abandons the failed one). Run once, the other release's rule: dropping those
    local gradients on 2.13 failed the backward case at step 1 (grad norm 0.4747975 !=
    0.3869809; the root's head and gate parameters), keeping them on 2.15 failed it the
    other way round (0.3869809 != 0.4747975)."""
    for rank, found in enumerate(run_ranks(mc.reset_iter_state, 2, script)):
        assert found["torch"]["failed_passes"] == 1, found
        ours = found["ours"]
        assert ours.get("differences") == [] and ours["failed_passes"] == 1, f"rank {rank}: {ours}"
        control = found["control"]
        if script is mc.FAILED_BACKWARD:
            assert control.get("differences", ["an error"]) != [], control
        else:
            assert control.get("differences") == [], control


def test_reset_iter_state_off_the_root_is_fsdp2s_error():
    for message in run_ranks(mc.reset_off_root, 2):
        assert message == "reset_iter_state must be called on the root FSDP module", message


@functools.cache
def _no_grad_runs() -> list[dict]:
    return run_ranks(mc.no_grad_runs, 2)


def test_forwards_without_grad_keep_the_root_gathered_as_torch_fsdp2():
    """After a training step, two forwards under ``torch.no_grad()``: torch's FSDP2
    releases each unit by its ``reshard_after_forward`` (the root's False), so the first
    gathers the root and both blocks and the second the blocks only, the root shown
    gathered after each; shardwrap's door the same on its ledger ([Note: a forward without
    grad on the FSDP2 door]), outputs and the next step's parameters equal bit for bit.
    Negative control (in the suite): its units freeing after a forward without grad, as
    the FSDP1 door's: the second forward gathers the root again (3 gathers, not 2)."""
    for found in _no_grad_runs():
        assert found["torch"] == {"gathers": [3, 2], "root_gathered": [True, True], "equal": True}
        assert found["shardwrap"] == found["torch"], found
        control = found["control"]
        assert control["gathers"] == [3, 3] and control["root_gathered"] == [False, False]
        assert control["equal"], control
