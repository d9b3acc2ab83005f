"""Rank workers for tests/dist/test_fsdp2_methods.py: FSDPModule's step-level knobs,
``set_unshard_in_backward`` and ``set_post_optim_event``, on both sides."""

from __future__ import annotations

import weakref
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import shardwrap
from shardwrap.fsdp2.state import state_of
from tests.dist import fsdp2_cases as fc


class Sharding:
    """shardwrap's ``fully_shard``, remembering the last module it was called on (the
    root, whose ledger holds every unit's collectives: [Note: adopted ledgers]).
    ``no_op``: the negative control, the named FSDPModule method made to do nothing."""

    def __init__(self, no_op: str | None = None) -> None:
        self.no_op = no_op
        self.root: nn.Module | None = None

    def __call__(self, module: nn.Module, **kwargs) -> nn.Module:
        shardwrap.fully_shard(module, **kwargs)
        if self.no_op is not None:
            setattr(module, self.no_op, lambda *args: None)
        self.root = module
        return module

    def param_gathers(self) -> dict[str, int]:
        """How many parameter all-gathers each unit issued over the run."""
        ledger = state_of(self.root).root.comm_ledger
        return dict(
            Counter(
                r.unit for r in ledger.records if (r.kind, r.purpose) == ("all_gather", "params")
            )
        )


NO_BACKWARD_GATHER = fc.Script(embed_unit=True)


def unshard_in_backward(rank: int, world_size: int) -> dict:
    """The embedding a unit of its own, ``set_unshard_in_backward(False)``: torch's run,
    shardwrap's and the control's (the method a no-op), each one's differences from
    torch's and its units' parameter gathers."""
    reference = fc.torch_run(rank, world_size, NO_BACKWARD_GATHER)
    found = {}
    for name, no_op in (("ours", None), ("control", "set_unshard_in_backward")):
        dist.barrier()
        sharding = Sharding(no_op)
        record = fc.run_script(sharding, rank, world_size, NO_BACKWARD_GATHER)
        found[name] = {
            "differences": fc.differences(reference, record),
            "gathers": sharding.param_gathers(),
        }
    return found


class NotedEvent(torch.Event):
    """A CPU event that notes each wait on it: how many parameter all-gathers the
    model's ledger held then (-1: torch's model, which has none)."""

    def wait(self, stream=None) -> None:
        self.waits.append(_gathers_of(self.model))
        super().wait(stream)


def _gathers_of(model: nn.Module) -> int:
    state = state_of(model)
    if state is None:
        return -1
    records = state.root.comm_ledger.records
    return sum((r.kind, r.purpose) == ("all_gather", "params") for r in records)


# Per run: one entry per optimizer step, [event, gathers when set, weakref to the previous].
_EVENTS: list[dict] = []


def set_event(model: nn.Module, step: int) -> None:
    """After each optimizer step: a new event, recorded, for the next forward to wait on."""
    event = NotedEvent("cpu")
    event.model, event.waits = model, []
    _EVENTS.append({"gathers_when_set": _gathers_of(model), "ref": weakref.ref(event)})
    model.set_post_optim_event(event)
    _EVENTS[-1]["event"] = event  # the test's own reference, dropped by _settle_events


def _events_seen() -> list[dict]:
    """Each event's waits, the gathers when it was set, and whether the model let it go
    (no reference left once the test drops its own)."""
    seen = []
    for entry in _EVENTS:
        event = entry.pop("event")
        waits = list(event.waits)
        event.model = None
        del event
        seen.append(
            {
                "waits": waits,
                "set_at": entry["gathers_when_set"],
                "held": entry["ref"]() is not None,
            }
        )
    _EVENTS.clear()
    return seen


WITH_EVENTS = fc.Script(after_step=set_event)


def post_optim_event(rank: int, world_size: int) -> dict:
    """An event set after every optimizer step: torch's run, shardwrap's and the
    control's (the method a no-op): differences from torch's, and what each event saw."""
    _EVENTS.clear()
    reference = fc.torch_run(rank, world_size, WITH_EVENTS)
    found = {"torch": {"events": _events_seen()}}
    for name, no_op in (("ours", None), ("control", "set_post_optim_event")):
        dist.barrier()
        record = fc.run_script(Sharding(no_op), rank, world_size, WITH_EVENTS)
        found[name] = {"differences": fc.differences(reference, record), "events": _events_seen()}
    return found


def refused_event(rank: int, world_size: int) -> str:
    """What an event that is not a torch.Event gets."""
    model = fc.sharded_tiny_model(world_size)
    try:
        model.set_post_optim_event("after the step")
    except TypeError as error:
        return str(error)
    return "accepted"


FAILED_FORWARD = fc.Script(fail_in="forward")
FAILED_BACKWARD = fc.Script(fail_in="backward")


def reset_iter_state(rank: int, world_size: int, script: fc.Script) -> dict:
    """A pass that raises, then ``reset_iter_state()``: torch's run, shardwrap's and the
    control's (the method a no-op): each one's differences from torch's (or its error)
    and how many passes raised."""
    reference = fc.torch_run(rank, world_size, script)
    found = {"torch": {"failed_passes": reference.failed_passes}}
    for name, no_op in (("ours", None), ("control", "reset_iter_state")):
        dist.barrier()
        try:
            record = fc.run_script(Sharding(no_op), rank, world_size, script)
        except (RuntimeError, AttributeError) as error:  # alike on every rank, in step
            found[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        found[name] = {
            "differences": fc.differences(reference, record),
            "failed_passes": record.failed_passes,
        }
    return found


def reset_off_root(rank: int, world_size: int) -> str:
    """What ``reset_iter_state`` on a block (not the root) gets."""
    model = fc.sharded_tiny_model(world_size)
    try:
        model.blocks[0].reset_iter_state()
    except RuntimeError as error:
        return str(error)
    return "accepted"


class _CountedGathers:
    """Counts torch's FSDP2 all-gathers (``dist.all_gather_single``, which its default
    all-gather calls) while in use."""

    def __init__(self) -> None:
        self.count = 0
        self._original = dist.all_gather_single

    def __enter__(self) -> _CountedGathers:
        def counted(*args, **kwargs):
            self.count += 1
            return self._original(*args, **kwargs)

        dist.all_gather_single = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_single = self._original


def no_grad_forwards(rank: int, world_size: int, side: str) -> dict:
    """A training step, two forwards under ``torch.no_grad()``, another training step, on
    ``side``'s ``fully_shard`` ("torch", "shardwrap", or "control": shardwrap's units
    freeing after a forward without grad, as the FSDP1 door's): the parameter gathers of
    each forward without grad, whether the root stays gathered, and the outputs."""
    model = fc.sharded_tiny(side, world_size)
    if side == "control":
        for module in model.modules():
            if state_of(module) is not None:
                state_of(module).unit.no_grad_follows_reshard_setting = False
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = _CountedGathers()

    def gathers() -> int:
        return counter.count if side == "torch" else _gathers_of(model)

    def train(step: int) -> None:
        idx, target = fc.batch(step, rank)
        F.cross_entropy(model(idx).reshape(-1, fc.OUT), target.reshape(-1)).backward()
        optim.step()
        optim.zero_grad()

    found: dict = {"gathers": [], "root_gathered": [], "outputs": []}
    with counter:
        train(0)
        for step in (1, 2):
            before = gathers()
            with torch.no_grad():
                found["outputs"].append(model(fc.batch(step, rank)[0]))
            found["gathers"].append(gathers() - before)
            found["root_gathered"].append(not isinstance(model.norm.weight, DTensor))
        train(3)
    found["params"] = {n: fc._plain(p.detach()) for n, p in model.named_parameters()}
    return found


def no_grad_runs(rank: int, world_size: int) -> dict:
    """:func:`no_grad_forwards` on each side: its gathers, whether the root stayed
    gathered, and whether its outputs and final parameters equal torch's bit for bit."""
    runs = {}
    for side in ("torch", "shardwrap", "control"):
        dist.barrier()
        runs[side] = no_grad_forwards(rank, world_size, side)
    reference = runs["torch"]
    found = {}
    for side, run in runs.items():
        outputs = zip(reference["outputs"], run["outputs"], strict=True)
        found[side] = {
            "gathers": run["gathers"],
            "root_gathered": run["root_gathered"],
            "equal": all(torch.equal(a, b) for a, b in outputs)
            and all(torch.equal(v, run["params"][n]) for n, v in reference["params"].items()),
        }
    return found
