"""Lightning's ``ModelParallelStrategy`` with FSDP2 code runs on shardwrap after
``shardwrap.install()``, unchanged, and equals torch's FSDP2 bit for bit.

Lightning's ``Trainer`` on 2 (and 3) CPU ranks, ``ModelParallelStrategy(data_parallel_size=N,
tensor_parallel_size=1)``: the module's ``configure_model`` calls ``fully_shard`` on each
block and the root over ``device_mesh["data_parallel"]`` (a 1-D slice of Lightning's 2-D
mesh), fits 3 steps, ``trainer.save_checkpoint`` writes Lightning's distributed
checkpoint (torch DCP through ``get_model_state_dict`` / ``get_optimizer_state_dict``), and
``fit(ckpt_path=...)`` resumes it to step 6. Run once with torch's FSDP2 and once with
shardwrap's door: the per-step losses and every parameter's ``full_tensor()`` after each
fit equal bit for bit (fp32), at 2 ranks and at 3 (where the door adds each gradient's three
terms in the order torch's gloo collective does: [Note: gloo's sum order]).

Negative control (run once): shardwrap's units given ``set_gradient_divide_factor(1.0)``
(gradients summed, not averaged) in ``configure_model``: the first fit's losses differ
from step 1 (26.184530 against torch's 26.184500).
"""

from __future__ import annotations

import lightning  # noqa: F401 (a declared test dependency: a broken install fails, never skips)
import pytest
import torch

from tests.dist import lightning_fsdp2_worker as worker
from tests.dist.harness import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_model_parallel_strategy_on_shardwrap_equals_torch_fsdp2(world_size, tmp_path) -> None:
    """At 3 ranks the sums follow gloo's order ([Note: gloo's sum order]); negative
    control (run once): the door's sums in rank order, losses and 21-23 parameters apart."""
    torch_run = run_ranks(worker.run, world_size, str(tmp_path), "torch")[0]
    ours = run_ranks(worker.run, world_size, str(tmp_path), "shardwrap")[0]
    assert torch_run["first"]["owner"] == ["torch"], torch_run["first"]["types"]
    assert ours["first"]["owner"] == ["shardwrap"], ours["first"]["types"]
    for fit in ("first", "resumed"):
        assert ours[fit]["losses"] == torch_run[fit]["losses"], fit
        for name, value in torch_run[fit]["params"].items():
            assert torch.equal(ours[fit]["params"][name], value), (fit, name)
    assert len(ours["resumed"]["losses"]) == 3
