"""``register_fsdp_forward_method`` on the FSDP2 door, against torch's FSDP2 running the
same script (tests/dist/fsdp2_forward_method_cases.py) at 2 ranks: the registered method's
outputs before any forward and after each of two AdamW steps, the losses, whether the
root's parameters are DTensors after the method (FSDP2's root stays gathered after a
forward), bit for bit; a module ``fully_shard`` was not called on is left untouched, and
a unit with a bf16 ``mp_policy`` is refused (FSDP2 casts around the method).

The method is called with grad enabled: under ``no_grad`` the door frees the root after a
forward where FSDP2 keeps it gathered, a difference of the door's forward, not of this.

Negative control (in the suite; run once): shardwrap's run without the registration
fails at the first call, the method seeing the root's DTensor chunks ("RuntimeError:
aten.embedding.default got mixed torch.Tensor and DTensor"), while torch's registered
run scores three times.
"""

from __future__ import annotations

from tests.dist import fsdp2_forward_method_cases as fm
from tests.dist.harness import run_ranks


def test_registered_method_equals_torch_fsdp2_bit_for_bit():
    for rank, found in enumerate(run_ranks(fm.compare, 2, True)):
        assert found == [], f"rank {rank}: {found[:8]}"


def test_torchs_name_after_install_registers_on_the_door():
    """torch's ``register_fsdp_forward_method``, called on a door module after
    ``shardwrap.install()`` (as torch's own test_fully_shard_training does), gives the same
    run bit for bit. Control (run once, the rebinding removed from install.py): torch's
    function leaves the door module as it is (not torch's FSDPModule) and the method's first
    call sees the DTensor chunks ("aten.embedding.default got mixed torch.Tensor and
    DTensor"); with torch's private FSDPModule name rebound as well, as
    benchmarks/torch_suite does, it fails at the call instead ("no attribute
    '_get_fsdp_state'")."""
    for rank, found in enumerate(run_ranks(fm.compare, 2, True, True)):
        assert found == [], f"rank {rank}: {found[:8]}"


def test_negative_control_unregistered_method_fails():
    for rank, found in enumerate(run_ranks(fm.compare, 2, False)):
        assert any(line.startswith("score 0:") for line in found), f"rank {rank}: {found[:8]}"
