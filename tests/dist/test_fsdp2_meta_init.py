"""Meta-device initialisation on the FSDP2 door, against torch's FSDP2 running the same
script (tests/dist/fsdp2_meta_cases.py): build on meta, ``fully_shard`` the blocks and the
root, ``to_empty(device="cpu")``, initialise in place on the DTensor parameters, then
AdamW steps. The model has a buffer, on meta too and set after ``to_empty``. At 2 ranks
the parameters right after init, and then the losses, gradient norms, parameters and
state dicts (the buffer's included) after every step, must agree bit for bit. Each run
also checks that ``model.to(torch.float64)`` after ``fully_shard`` is refused before it
converts anything (the flat shard has one dtype).

The ``assign`` case loads instead of initialising, as accelerate's
``fsdp2_load_full_state_dict`` does (``cpu_ram_efficient_loading``): a full model's
weights ``distribute_tensor`` ed onto each sharded parameter's mesh and placements, then
``load_state_dict(sharded, assign=True)`` on the meta-sharded model ([Note: assigned
parameters on the FSDP2 door]); it also checks that a plain tensor (TypeError) and a
float64 DTensor (ValueError) are refused naming the parameter, before anything is
assigned. Negative control, run once: the door's assign hooks not registered: both
refusals let through, the parameters after the load still agree (``full_tensor()``
reads the assigned objects), but the engine trains its zeroed shards: step 0's loss
1.3890721 against torch's 1.4478896, grad norm 0.0435 against 0.2609, every parameter
after every step differing.

Negative controls, run once (2 ranks, ``init_fn``). ``FSDPModule._apply`` made a plain
``nn.Module._apply`` (the classic bug: ``to_empty`` swaps each DTensor parameter for new
storage, the init lands there and not in the engine's flat shard): the parameters after
init still agree (``full_tensor()`` reads the swapped copies), but the engine trains the
all-zero model: step 0's loss 1.3862947 (log 4) against torch's 1.3821474, grad norm
0.0393 against 0.2225, every parameter after every step differing (224 lines per rank;
with ``reset`` the same, torch's loss 1.3676676). In the suite: the same bug put in by
the script (each parameter swapped for a copy after ``to_empty``, fsdp2_meta_cases
``copy_after_to_empty``): again the init agrees and step 0's loss differs (nan: the
flat shard holds ``to_empty``'s uninitialised memory).
"""

from __future__ import annotations

import pytest

from tests.dist import fsdp2_meta_cases as mc
from tests.dist.harness import run_ranks


@pytest.mark.parametrize("init", ["init_fn", "reset", mc.ASSIGN])
def test_meta_init_equals_torch_fsdp2_bit_for_bit(init):
    for rank, found in enumerate(run_ranks(mc.compare, 2, init, False)):
        assert found == [], f"rank {rank}: {found[:8]}"


def test_negative_control_init_into_a_copy_differs():
    for rank, found in enumerate(run_ranks(mc.compare, 2, "init_fn", True)):
        assert not any(line.startswith("init:") for line in found), found[:8]
        assert any("step 0: loss" in line for line in found), f"rank {rank}: {found[:8]}"
