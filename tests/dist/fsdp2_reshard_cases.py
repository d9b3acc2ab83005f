"""Rank workers for tests/dist/test_fsdp2_reshard_size.py: ``reshard_after_forward=2`` at 4
ranks on both sides."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh

import shardwrap
from shardwrap.fsdp2.state import state_of
from tests.dist import fsdp2_cases as fc
from tests.tolerances import REORDER_SAFE_ADAMW

GROUP = 2  # the blocks reshard to pairs of ranks after forward
# At 4 ranks the gradient sums' order differs between gloo's reduce-scatter (torch) and
# shardwrap's, so values are compared within the bounds of tests/tolerances.py, under the
# AdamW those bounds hold for (as the door's 3-rank test does).
SCRIPT = fc.Script(adamw=(*REORDER_SAFE_ADAMW.items(), ("weight_decay", 0.1)), block_reshard=GROUP)
REORDERED = fc.REORDERED


class Recording:
    """shardwrap's ``fully_shard`` that remembers the modules it was called on; ``as_true``
    is the negative control: an int ``reshard_after_forward`` handed on as True
    (resharded to the whole shard group)."""

    def __init__(self, as_true: bool = False) -> None:
        self.as_true = as_true
        self.modules: list[nn.Module] = []

    def __call__(self, module: nn.Module, **kwargs) -> nn.Module:
        if self.as_true and not isinstance(kwargs.get("reshard_after_forward", True), bool):
            kwargs["reshard_after_forward"] = True
        self.modules.append(shardwrap.fully_shard(module, **kwargs))
        return module

    def gather_group_sizes(self) -> dict[str, set[int]]:
        """The group sizes of each unit's parameter all-gathers over the run, from the
        root's ledger (the root, called last, adopted the blocks' ledgers: [Note: adopted
        ledgers] in comm/ledger.py)."""
        sizes: dict[str, set[int]] = {}
        for record in state_of(self.modules[-1]).root.comm_ledger.records:
            if record.kind == "all_gather" and record.purpose == "params":
                sizes.setdefault(record.unit, set()).add(record.group_size)
        return sizes


def compare(rank: int, world_size: int) -> dict:
    """torch's run, shardwrap's, and the negative control's, with
    ``reshard_after_forward=2`` on the blocks: each one's differences from torch's, and
    the group sizes of its parameter gathers."""
    reference = fc.torch_run(rank, world_size, SCRIPT)
    found = {}
    for name, as_true in (("ours", False), ("control", True)):
        dist.barrier()
        shard = Recording(as_true)
        record = fc.run_script(shard, rank, world_size, SCRIPT)
        found[name] = {
            "differences": fc.differences(reference, record, REORDERED),
            "sizes": shard.gather_group_sizes(),
        }
    return found


def edge_sizes(rank: int, world_size: int) -> dict:
    """What each side does with 3 (no factor of 4) and 1 (torch: False, with a logged
    warning; shardwrap: False, with a ``UserWarning``)."""
    mesh = init_device_mesh("cpu", (world_size,))
    found = {}
    for name, shard in (("torch", torch_fsdp.fully_shard), ("shardwrap", shardwrap.fully_shard)):
        with pytest.raises(ValueError) as error:
            shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)
        found[f"{name} 3"] = str(error.value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=1)
        if name == "shardwrap":
            found["warned"] = any("reshard_after_forward=1" in str(w.message) for w in caught)
            found["keeps"] = state_of(module).reshard_after_forward
    return found
