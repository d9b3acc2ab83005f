"""Around an optimizer's step: what shardwrap does before and after it, in one written order.

[Note: one optimizer-step dispatcher]
Three owners act around ``optimizer.step()``: a root's step runtime (ZeRO-1's reduction of
what ``no_sync`` backwards left, the note that stepped shards make gathered copies stale),
a DiskOffload store (Adam state into mapped files, the step streamed in sub-groups, the
release of resident pages), and the check that no optimizer steps parameters wrapping
replaced (assemble/optimizer_guard.py). Each joins here with the :class:`Phase` actions it
takes, and every optimizer that steps a participant's shards gets one pre-hook and one
post-hook that run the phases in :data:`BEFORE_STEP` / :data:`AFTER_STEP` order, each
phase for every participant owning the optimizer, in the order they joined.

The optimizer's pair is registered when a model meets it: at its first step that holds a
participant's shard views, found by one global step pre-hook (which also runs the
checks). The optimizer's own pre-hook runs after every global one, in that same step, and
after the hooks the optimizer already had; its post-hook runs after those too, and before
every global post-hook. A pair is removed when no live participant owns its optimizer
any more, and the global hook when the last participant is gone: nothing is left
registered in the process once every model and store is.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle


class Phase(enum.Enum):
    """One thing done around an optimizer step (the order is :data:`BEFORE_STEP`,
    :data:`AFTER_STEP`)."""

    FLUSH_DEFERRED_GRADS = "flush deferred grads"  # ZeRO-1: reduce what no_sync left
    PLACE_STATE = "place state"  # DiskOffload: Adam state in mapped files; streamed step
    RESTORE_GRADS = "restore grads"  # DiskOffload: give back what the streamed step hid
    NOTE_STALE = "note stale"  # stepped shards: the gathered copies are stale
    RELEASE_PAGES = "release pages"  # DiskOffload: drop the mapped buffers' resident pages


# Gradients must be complete before the state is placed and the step streamed; the
# streamed step's hidden gradients must be back before the stale note looks for them.
BEFORE_STEP = (Phase.FLUSH_DEFERRED_GRADS, Phase.PLACE_STATE)
AFTER_STEP = (Phase.RESTORE_GRADS, Phase.NOTE_STALE, Phase.RELEASE_PAGES)

# (participant, optimizer, args, kwargs) -> None; a plain function, so the dispatcher
# holds participants weakly.
Action = Callable[[Any, torch.optim.Optimizer, tuple, dict], None]
Owns = Callable[[Any, torch.optim.Optimizer], bool]
Check = Callable[[torch.optim.Optimizer, tuple, dict], None]  # (optimizer, args, kwargs)


@dataclass(frozen=True)
class _Participant:
    ref: weakref.ref
    owns: Owns
    actions: Mapping[Phase, Action]


_PARTICIPANTS: list[_Participant] = []  # in the order they joined
# Each hooked optimizer's (pre-hook, post-hook).
_HOOKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[RemovableHandle, ...]] = (
    weakref.WeakKeyDictionary()
)
_CHECKS: list[Check] = []  # run on every optimizer's step while any participant lives
_GLOBAL_HOOK: list[RemovableHandle] = []  # the one global pre-hook, while any participant lives
# What the step itself sees of the parameters ([Note: stepping the local shards] in
# fsdp2/local_step.py): (enter, leave), entered after every before-step phase and left
# before any after-step one, or at the next step's start if the step raised.
_STEP_VIEWS: list[tuple[Check, Callable[[torch.optim.Optimizer], None]]] = []


def join(participant: object, owns: Owns, actions: Mapping[Phase, Action]) -> None:
    """``participant`` takes ``actions`` around every step of an optimizer it ``owns``.

    Held weakly: it leaves when collected, or by :func:`leave`.
    """
    _PARTICIPANTS.append(_Participant(weakref.ref(participant, _forget), owns, dict(actions)))
    if not _GLOBAL_HOOK:
        _GLOBAL_HOOK.append(register_optimizer_step_pre_hook(_meet))


def leave(participant: object) -> None:
    """``participant`` takes no more part in any step (a no-op if it never joined)."""
    _PARTICIPANTS[:] = [p for p in _PARTICIPANTS if p.ref() not in (None, participant)]
    _unhook_unowned()


def add_check(check: Check) -> None:
    """Run ``check`` on every optimizer's step (once added; while any participant lives)."""
    if check not in _CHECKS:
        _CHECKS.append(check)


def set_step_views(enter: Check, leave: Callable[[torch.optim.Optimizer], None]) -> None:
    """Let ``enter`` change what a hooked optimizer's step sees, ``leave`` undo it."""
    if (enter, leave) not in _STEP_VIEWS:
        _STEP_VIEWS.append((enter, leave))


def hooked_optimizers() -> list[torch.optim.Optimizer]:
    """The optimizers that carry a dispatcher pair now."""
    return list(_HOOKED.keys())


def _forget(ref: weakref.ref) -> None:
    # A weakref callback: at interpreter exit this module's globals may be gone already.
    try:
        _PARTICIPANTS[:] = [p for p in _PARTICIPANTS if p.ref is not ref and p.ref() is not None]
        _unhook_unowned()
    except Exception:
        pass


def _owning(optimizer: torch.optim.Optimizer) -> list[tuple[_Participant, Any]]:
    live = [(p, p.ref()) for p in list(_PARTICIPANTS)]
    return [(p, owner) for p, owner in live if owner is not None and p.owns(owner, optimizer)]


def _unhook_unowned() -> None:
    for optimizer, handles in list(_HOOKED.items()):
        if not _owning(optimizer):
            for handle in handles:
                handle.remove()
            del _HOOKED[optimizer]
    if not _PARTICIPANTS:
        for handle in _GLOBAL_HOOK:
            handle.remove()
        _GLOBAL_HOOK.clear()


def _meet(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for _, leave_views in _STEP_VIEWS:  # a step that raised left them
        leave_views(optimizer)
    for check in list(_CHECKS):
        check(optimizer, args, kwargs)
    if optimizer not in _HOOKED and _owning(optimizer):
        _HOOKED[optimizer] = (
            optimizer.register_step_pre_hook(_before_step),
            optimizer.register_step_post_hook(_after_step),
        )


def _run(phases: tuple[Phase, ...], owning, optimizer: torch.optim.Optimizer, args, kwargs):
    """``phases`` for the ``owning`` participants (:func:`_owning`'s) of ``optimizer``."""
    for phase in phases:
        for participant, owner in owning:
            action = participant.actions.get(phase)
            if action is not None:
                action(owner, optimizer, args, kwargs)


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    owning = _owning(optimizer)
    _run(BEFORE_STEP, owning, optimizer, args, kwargs)
    if not any(Phase.PLACE_STATE in p.actions for p, _ in owning):
        for enter_views, _ in _STEP_VIEWS:  # not under a DiskOffload's streamed step
            enter_views(optimizer, args, kwargs)


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for _, leave_views in _STEP_VIEWS:  # first: ownership reads the optimizer's own params
        leave_views(optimizer)
    _run(AFTER_STEP, _owning(optimizer), optimizer, args, kwargs)
