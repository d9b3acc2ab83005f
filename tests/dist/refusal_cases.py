"""Rank workers for refused checkpoint loads: each refusal must leave every rank as it was.

"As it was" is everything a load may change: the model's parameters and buffers, the
optimizer's state and settings, the sampler's position and the random streams (torch,
Python, NumPy). :func:`run_snapshot` takes all of it; :func:`changes` names what differs.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import random
import traceback
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed.distributed_c10d as c10d

from shardwrap import CheckpointError, ResumableSampler, load_checkpoint, save_checkpoint
from shardwrap.ckpt.slots import model_slots
from tests import models
from tests.dist import parity
from tests.dist.ckpt_workers import wrap

NUM_SAMPLES = 24
GLOBAL_BATCH = 4
SAMPLER_SEED = 5


class Case(NamedTuple):
    """One load: the folder, the model (``TinyGPT`` keyword arguments, or ``{"mlp": True}``),
    ``strict`` (without it, no optimizer either), and another sampler seed on rank 1."""

    path: str
    model: dict = {}
    strict: bool = True
    rank1_sampler_seed: int | None = None


def _sampler(rank: int, world_size: int, seed: int = SAMPLER_SEED) -> ResumableSampler:
    return ResumableSampler(
        NUM_SAMPLES, global_batch_size=GLOBAL_BATCH, rank=rank, world_size=world_size, seed=seed
    )


def _trained(rank: int, world_size: int, model: torch.nn.Module, seed: int):
    """``model`` wrapped FULL_SHARD with AdamW, one step taken (so the optimizer has state)."""
    kind = "mlp" if isinstance(model, models.MLP) else "gpt"
    sharded = wrap(model, world_size, "FULL_SHARD")
    optim = parity.make_optimizer(sharded, "adamw")
    parity.loss_for(kind, sharded, parity.batch_for(kind, seed + rank), 1).backward()
    optim.step()
    optim.zero_grad()
    return sharded, optim


def save_with_sampler(rank: int, world_size: int, folder: str) -> None:
    """A TinyGPT checkpoint with optimizer state, a data position and random streams."""
    torch.manual_seed(1234)
    sharded, optim = _trained(rank, world_size, models.TinyGPT(), 0)
    sampler = _sampler(rank, world_size)
    next(iter(sampler))
    save_checkpoint(folder, sharded, optim, sampler=sampler, extra={"step": 1})


def run_snapshot(model, optim, sampler) -> dict[str, Any]:
    """Everything of this rank a load may change (copies)."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "optimizer": copy.deepcopy(optim.state_dict()) if optim is not None else None,
        "sampler": sampler.state_dict() if sampler is not None else None,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(legacy=True),
    }


def changes(before: Any, after: Any, where: str = "") -> list[str]:
    """Where ``after`` differs from ``before`` (tensors bit for bit), as paths."""
    if isinstance(before, dict) and isinstance(after, dict):
        if before.keys() != after.keys():
            return [f"{where}: keys {sorted(map(str, before))} -> {sorted(map(str, after))}"]
        return [d for key in before for d in changes(before[key], after[key], f"{where}/{key}")]
    if isinstance(before, list | tuple) and isinstance(after, list | tuple):
        if len(before) != len(after):
            return [f"{where}: {len(before)} -> {len(after)} items"]
        if not any(isinstance(v, dict | list | tuple | torch.Tensor | np.ndarray) for v in before):
            return [] if before == after else [where]  # plain values: one leaf
        return [
            d for i, (b, a) in enumerate(zip(before, after)) for d in changes(b, a, f"{where}[{i}]")
        ]
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        same = isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
        return [] if same and torch.equal(before, after) else [where]
    if isinstance(before, np.ndarray):
        return [] if np.array_equal(before, after) else [where]
    return [] if before == after else [where]


def _one_load(rank: int, world_size: int, case: Case) -> tuple[str, list[str]]:
    torch.manual_seed(3)
    model = models.MLP() if case.model.get("mlp") else models.TinyGPT(**case.model)
    sharded, optim = _trained(rank, world_size, model, 40)
    seed = case.rank1_sampler_seed if rank == 1 and case.rank1_sampler_seed else SAMPLER_SEED
    sampler = _sampler(rank, world_size, seed)
    next(iter(sampler))
    next(iter(sampler))  # a position other than the saved one
    torch.manual_seed(100 + rank)  # streams other than the saved ones, by rank
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    optim = optim if case.strict else None
    before = run_snapshot(sharded, optim, sampler)
    try:
        load_checkpoint(case.path, sharded, optim, strict=case.strict, sampler=sampler)
    except CheckpointError as exc:
        return str(exc), changes(before, run_snapshot(sharded, optim, sampler))
    return "ok", []


def refused_loads(rank: int, world_size: int, cases: list[Case]) -> list[tuple[str, list[str]]]:
    """For each case: ``("ok", [])``, or the error and what the refused load changed."""
    return [_one_load(rank, world_size, case) for case in cases]


@contextlib.contextmanager
def unpickling_recorded():
    """Record (and let run) every unpickling: ``pickle.load``/``loads``/``Unpickler``, and
    the ``Unpickler`` torch.distributed's object collectives bound at import."""
    calls: list[str] = []
    saved = (pickle.load, pickle.loads, pickle.Unpickler, c10d._unpickler)

    def note(what: str) -> None:
        calls.append(f"{what} from {traceback.format_stack(limit=4)[0].strip()}")

    class Recorded(pickle.Unpickler):
        def __init__(self, *args, **kwargs) -> None:
            note("Unpickler")
            super().__init__(*args, **kwargs)

    def load(*args, **kwargs):
        note("pickle.load")
        return saved[0](*args, **kwargs)

    def loads(*args, **kwargs):
        note("pickle.loads")
        return saved[1](*args, **kwargs)

    pickle.load, pickle.loads, pickle.Unpickler, c10d._unpickler = load, loads, Recorded, Recorded
    try:
        yield calls
    finally:
        pickle.load, pickle.loads, pickle.Unpickler, c10d._unpickler = saved


def loads_unpickle(rank: int, world_size: int, good: str, refused: str) -> dict[str, list[str]]:
    """What unpickles during a load, a refused load, and (the negative control) an object
    broadcast, which pickles."""
    torch.manual_seed(3)
    sharded, optim = _trained(rank, world_size, models.TinyGPT(), 40)
    sampler = _sampler(rank, world_size)
    found = {}
    with unpickling_recorded() as calls:
        load_checkpoint(good, sharded, optim, sampler=sampler)
    found["load"] = list(calls)
    with unpickling_recorded() as calls:
        try:
            load_checkpoint(refused, sharded, optim, sampler=sampler)
            found["refusal"] = ["not refused"]
        except CheckpointError as exc:
            found["refusal"] = [str(exc)]
    found["refused load"] = list(calls)
    with unpickling_recorded() as calls:
        model_slots(sharded).world_comm.broadcast_object(["a name"], purpose="test")
    found["broadcast_object"] = list(calls)
    return found
