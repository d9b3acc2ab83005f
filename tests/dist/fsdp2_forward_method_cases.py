"""Rank workers for tests/dist/test_fsdp2_forward_method.py: ``register_fsdp_forward_method``.

The script registers ``score`` (a method other than ``forward`` that reads the root
unit's ``head`` parameters directly and calls the blocks) on the root, calls it before
any forward, trains two AdamW steps, and calls it again; it runs with torch's
``fully_shard``/``register_fsdp_forward_method`` and with shardwrap's, and the test
compares the two records bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardwrap
from tests.dist import fsdp2_cases as fc

NUM_STEPS = 2


class ScoringModel(fc.TinyModel):
    def score(self, idx: torch.Tensor) -> torch.Tensor:
        """The head's logits without the gate, its parameters read directly."""
        x = self.norm(self.embed(idx))
        for block in self.blocks:
            x = block(x)
        return x @ self.head.weight.t() + self.head.bias


def run(shard: Callable, register: Callable | None, rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = ScoringModel()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    plain = nn.Linear(2, 2)
    record: dict = {"scores": [], "losses": [], "head_after_score": []}
    if register is not None:
        register(model, "score")
        register(plain, "forward")  # not an FSDPModule: left as it is
    record["plain_untouched"] = "forward" not in vars(plain)
    optim = torch.optim.AdamW(model.parameters(), lr=fc.LR)
    idx, _ = fc.batch(99, rank)
    for step in range(NUM_STEPS + 1):
        try:
            # With grad enabled: under no_grad the door frees the root after its forward,
            # where FSDP2 keeps it gathered (a difference of the door's forward itself).
            record["scores"].append(model.score(idx).detach().clone())
        except Exception as error:  # the negative control's failure, recorded
            record["scores"].append(f"{type(error).__name__}: {error}"[:120])
            return record
        record["head_after_score"].append(isinstance(model.head.weight, DTensor))
        if step == NUM_STEPS:
            break
        idx_b, target = fc.batch(step, rank)
        loss = F.cross_entropy(model(idx_b).reshape(-1, fc.OUT), target.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        record["losses"].append(float(loss.detach()))
    return record


def _ours(rank: int, world_size: int, registered: bool, installed: bool) -> dict:
    """shardwrap's run: its own names, or torch's names after ``shardwrap.install()``
    (torch's ``register_fsdp_forward_method`` reads torch's FSDP state, which a door
    module has not, so install() rebinds it too)."""
    if not installed:
        register = shardwrap.register_fsdp_forward_method if registered else None
        return run(shardwrap.fully_shard, register, rank, world_size)
    shardwrap.install()
    try:
        return run(
            torch_fsdp.fully_shard, torch_fsdp.register_fsdp_forward_method, rank, world_size
        )
    finally:
        shardwrap.uninstall()


def compare(rank: int, world_size: int, registered: bool, installed: bool = False) -> list[str]:
    """torch's run, then shardwrap's (``registered=False``: without the registration,
    the negative control; ``installed``: through torch's names); the differences, one
    line each."""
    reference = run(
        torch_fsdp.fully_shard, torch_fsdp.register_fsdp_forward_method, rank, world_size
    )
    dist.barrier()
    ours = _ours(rank, world_size, registered, installed)
    found = mixed_precision_refused(world_size)
    for key in ("losses", "head_after_score", "plain_untouched"):
        if reference[key] != ours[key]:
            found.append(f"{key}: {reference[key]} != {ours[key]}")
    for step, (a, b) in enumerate(zip(reference["scores"], ours["scores"], strict=False)):
        if not (isinstance(b, torch.Tensor) and torch.equal(a, b)):
            found.append(f"score {step}: {b if isinstance(b, str) else 'values differ'}")
    if len(reference["scores"]) != len(ours["scores"]):
        found.append(f"scores: {len(reference['scores'])} != {len(ours['scores'])}")
    return found


def mixed_precision_refused(world_size: int) -> list[str]:
    """A line if registering on a unit with a bf16 ``mp_policy`` is not refused (FSDP2
    casts the method's inputs and outputs; the engine's wrapper does not)."""
    model = ScoringModel()
    policy = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    shardwrap.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)), mp_policy=policy)
    try:
        shardwrap.register_fsdp_forward_method(model, "score")
    except NotImplementedError as error:
        if "mixed-precision" in str(error):
            return []
    return ["register_fsdp_forward_method under a bf16 mp_policy: not refused"]
