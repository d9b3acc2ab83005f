"""Rank workers for the checkpoint tiers (tests/dist/test_checkpoint_tiers.py).

One script, run twice in the same ranks: the *uninterrupted* run trains ``TOTAL_STEPS``
steps, calling ``save_tiered`` after each of the first ``FAULT_AFTER``; then a fault
(nothing, a lost node's memory folder, damaged files), then a *restarted* run builds the
model afresh (another seed, other random streams), loads the newest good checkpoint of
the tiers and trains to ``TOTAL_STEPS``. Its losses from the resumed step on, its
parameter shards and its optimizer state must be the uninterrupted run's, bit for bit
(dropout and input noise make the random streams matter).
"""

from __future__ import annotations

import os
import random
import shutil
import threading

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import shardwrap
from shardwrap import CheckpointTiers, ResumableSampler, save_tiered
from shardwrap.checkpoint import CheckpointError, load_newest
from shardwrap.ckpt import save as checkpoint_save
from shardwrap.ckpt import selection as selection_module
from shardwrap.ckpt.async_save import AsyncSave
from shardwrap.ckpt.format import SHARD_FILE_PATTERN
from shardwrap.policies import ModuleWrapPolicy

TOTAL_STEPS = 9
FAULT_AFTER = 6  # the last step the uninterrupted run saves; the fault comes after it
NUM_SAMPLES = 64


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _build(rank: int, world_size: int, init_seed: int):
    torch.manual_seed(init_seed)
    model = shardwrap.ShardedModule(
        DropoutMLP(), sharding_strategy="FULL_SHARD", auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
    )
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)
    sampler = ResumableSampler(
        NUM_SAMPLES, global_batch_size=2 * world_size, rank=rank, world_size=world_size, seed=3
    )
    return model, optim, sampler


def _seed_streams(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed + 1)
    np.random.seed(seed + 2)


def _one_step(model, optim, batches, data) -> float:
    x_all, y_all = data
    indices = next(batches)
    x = (
        x_all[indices]
        + random.random() * torch.from_numpy(np.random.randn(len(indices), 8)).float()
    )
    loss = nn.functional.mse_loss(model(x), y_all[indices])
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _state(model, optim) -> list[torch.Tensor]:
    """This rank's parameter shards and optimizer state tensors, in a fixed order."""
    tensors = [p.detach().clone() for p in model.parameters()]
    for param in model.parameters():
        for key in sorted(optim.state.get(param, {})):
            tensors.append(optim.state[param][key].detach().clone())
    return tensors


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(NUM_SAMPLES, 8, generator=g), torch.randn(NUM_SAMPLES, 1, generator=g)


def _fault(rank: int, tiers: CheckpointTiers, fault: str) -> None:
    """World rank 0 breaks the tiers as ``fault`` says; every rank waits for it."""
    if rank == 0:
        if fault.startswith("lose_node"):  # a node's memory is gone (its replacement: empty)
            shutil.rmtree(tiers.node_folder(int(fault.removeprefix("lose_node"))))
        elif fault == "corrupt_newest":  # every copy of one file of the newest step
            for node in (0, 1):
                _flip_byte(_shard_file(tiers, node, FAULT_AFTER, rank=1))
        elif fault == "corrupt_one_copy":  # node 0's own file; node 1 holds a good copy
            _flip_byte(_shard_file(tiers, 0, FAULT_AFTER, rank=0))
        else:
            assert fault == "none", fault
    dist.barrier()


def _shard_file(tiers: CheckpointTiers, node: int, step: int, rank: int) -> str:
    folder = os.path.join(tiers.node_folder(node), f"step-{step:09d}")
    (name,) = [
        n for n in os.listdir(folder) if SHARD_FILE_PATTERN.match(n) and f"rank{rank:05d}" in n
    ]
    return os.path.join(folder, name)


def _flip_byte(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) - 3)  # in the tensor data, past the header
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x40]))


def run_fault_resume(
    rank: int, world_size: int, tiers_kwargs: dict, fault: str, bypass_digests: bool = False
) -> dict:
    """The uninterrupted run, ``fault``, the restarted run; what it chose and whether it
    matched. ``bypass_digests`` (a negative control): the selection takes every file as
    verified."""
    tiers = CheckpointTiers(**tiers_kwargs)
    data = _data()
    model, optim, sampler = _build(rank, world_size, init_seed=0)
    _seed_streams(100 + rank)
    batches, losses, pending, background = iter(_endless(sampler)), {}, None, False
    for step in range(1, TOTAL_STEPS + 1):
        losses[step] = _one_step(model, optim, batches, data)
        if step <= FAULT_AFTER:
            saved = save_tiered(tiers, step, model, optim, extra={"step": step}, sampler=sampler)
            for handle in (saved.memory, saved.disk):  # every save waits for the one before
                pending = handle if isinstance(handle, AsyncSave) else pending
            background |= isinstance(saved.memory, AsyncSave)
    if pending is not None:
        pending.result()  # the last save may still be written in the background
    expected = _state(model, optim)
    del model, optim

    _fault(rank, tiers, fault)
    model, optim, sampler = _build(rank, world_size, init_seed=1)
    _seed_streams(999)
    original = selection_module._verify
    if bypass_digests:
        selection_module._verify = _unchecked
    try:
        resumed = load_newest(tiers, model, optim, sampler=sampler)
    except CheckpointError as exc:
        return {"error": str(exc)}
    finally:
        selection_module._verify = original
    start = resumed.extra["step"]
    batches = iter(_endless(sampler))
    again = {s: _one_step(model, optim, batches, data) for s in range(start + 1, TOTAL_STEPS + 1)}
    got = _state(model, optim)
    exact = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    chosen = resumed.selection.chosen
    return {
        "folder": sorted(os.listdir(resumed.selection.path)),
        "background": background,  # a memory-tier save returned a handle
        "chosen": (chosen.tier.value, chosen.step),
        "skipped": [(s.candidate.tier.value, s.candidate.step, s.reason.value, s.detail)
                    for s in resumed.selection.skipped],
        "losses_equal": again == {s: losses[s] for s in again},
        "first_loss_gap": abs(again[start + 1] - losses[start + 1]),
        "state_equal": exact,
    }  # fmt: skip


def _unchecked(folder, index, name):
    entry = index.files.get(name)
    return None, entry.sha256 if entry is not None else "unchecked"


def _endless(sampler):
    while True:
        yield from sampler


def save_one_step_twice(rank: int, world_size: int, tiers_kwargs: dict) -> list[str]:
    """Save step 2 of the memory tier twice; this rank's node folder of it afterwards."""
    tiers = CheckpointTiers(**tiers_kwargs)
    model, optim, sampler = _build(rank, world_size, init_seed=0)
    for _ in range(2):
        save_tiered(tiers, 2, model, optim, sampler=sampler)
    return sorted(os.listdir(os.path.join(tiers.node_folder(rank), f"step-{2:09d}")))


def peer_traffic(rank: int, world_size: int, tiers_kwargs: dict) -> dict:
    """One memory-tier save: the bytes this rank sent for the peer copy, and its files."""
    tiers = CheckpointTiers(**tiers_kwargs)
    model, optim, sampler = _build(rank, world_size, init_seed=0)
    ledger = model.comm_ledger
    before = ledger.num_recorded
    saved = save_tiered(tiers, tiers.memory_every, model, optim, sampler=sampler)
    assert saved.memory is not None and saved.disk is None, saved
    sends = [r.num_bytes for r in ledger.recorded_since(before) if r.kind == "send"]
    own = [n for n in os.listdir(saved.memory) if f"-rank{rank:05d}." in n]
    return {
        "sends": sends,
        "own_bytes": sum(os.path.getsize(os.path.join(saved.memory, n)) for n in own),
    }


def load_during_background_save(rank: int, world_size: int, tiers_kwargs: dict) -> str:
    """Save step 2 of the memory tier in the background, its writes held back 0.3 s, and
    load the tiers into the same model at once (a rollback); what it took, or its error."""
    tiers = CheckpointTiers(**tiers_kwargs)
    model, optim, sampler = _build(rank, world_size, init_seed=0)
    gate, original = threading.Event(), checkpoint_save.write_stream

    def held_back(*args, **kwargs):
        if not gate.wait(60.0):
            raise RuntimeError("the test's gate never opened")
        return original(*args, **kwargs)

    checkpoint_save.write_stream = held_back
    try:
        handle = save_tiered(tiers, 2, model, optim, sampler=sampler).memory
        assert isinstance(handle, AsyncSave) and not handle.done()
        threading.Timer(0.3, gate.set).start()
        try:
            resumed = load_newest(tiers, model, optim, sampler=sampler)
        except CheckpointError as exc:
            return f"error: {exc}"
        finally:
            gate.set()
            handle.result()
    finally:
        checkpoint_save.write_stream = original
    return str(resumed.selection.chosen.step)
