"""The free rule: what a unit gives up of its gathered parameters, and at which moment.

[Note: the free rule]
What a unit gives up, and when, is one function (:func:`release_rule`), by moment:

* post-forward (outermost forward only, not a forward re-run in backward): without grad
  (unless the unit follows its setting without grad too, below), or when it reshards
  after forward and, with grad, the schedule does not keep it ([Note: the last unit of
  forward stays gathered]), it shows its shard and frees the gathered buffer if its
  strategy frees after backward (all but ZeRO-1 and NO_SHARD), else keeps it;
  otherwise a unit whose optimizer step reduces (ZeRO-1) shows its shard over the kept
  buffer, a unit computing on its mapped shard itself (DiskOffload, one shard) drops the
  shard's resident pages, and any other stays gathered into backward;
* abandoned (a new forward began before backward): a freeing unit shows its shard, and
  frees the buffer unless more microbatches follow; one that follows its setting without
  grad and does not reshard after forward stays gathered;
* post-backward: it shows its shard, and frees the buffer if its strategy frees and
  ``reshard_after_backward`` is on;
* a user's call (``FSDPModule.reshard``, outside the step): it shows its shard, and frees
  the buffer if its strategy frees;
* end of backward: a gather issued but never used is waited for, then the unit shows its
  shard (and frees it when freeing and the step ends); a freeing unit that a bucket
  gathered but the step did not use frees it, unless ``reshard_after_backward`` is off.

The step runtime (runtime/step.py) asks at each moment and does what the answer says.

A unit told to keep its gathered storage (``Unit.keeps_full_storage``, FSDP2's
``set_keep_unsharded_storage``) keeps it wherever it would free (``Release.KEEP_STORAGE``):
the buffer, and so the full views' storage and data pointers, stay from gather to gather,
while its values count as stale, so the next unshard all-gathers into it again, as
FSDP2's does (it skips only the freeing).

[Note: a forward without grad on the FSDP2 door]
An evaluation forward (under ``torch.no_grad()``) frees every unit on the FSDP1 and
DeepSpeed doors: no backward will follow. FSDP2 releases each unit by its
``reshard_after_forward`` with or without grad, so its root (False by default) stays
gathered after an evaluation forward, and the next forward (evaluation or training)
gathers it no more. The FSDP2 door's units follow that
(``Unit.no_grad_follows_reshard_setting``): such a unit stays gathered after a forward
without grad, and when the next forward abandons it (no backward ran), as under FSDP2.
The next gather still happens whenever the shard changed since (an optimizer step):
``FlatParamHandle.unshard`` compares versions.
"""

from __future__ import annotations

import enum

from ..core.unit import TrainingState, Unit


class Moment(enum.Enum):
    """Where in a step a unit may give up its gathered parameters."""

    POST_FORWARD = "post-forward"
    ABANDONED = "abandoned"  # a new forward began before this unit's backward ran
    POST_BACKWARD = "post-backward"
    END_OF_BACKWARD = "end of backward"
    USER_CALL = "a user's reshard"  # FSDPModule.reshard, outside the step


class Release(enum.Enum):
    """What a unit gives up at a moment (see [Note: the free rule])."""

    KEEP = "keep"  # full parameters stay gathered and shown
    SHOW_SHARD = "show shard"  # shard views shown; the gathered buffer is kept
    FREE = "free"  # shard views shown; the gathered buffer's storage is freed
    # FREE for a unit keeping its storage: shard views shown, the buffer kept, its values
    # stale (the next unshard gathers into it again)
    KEEP_STORAGE = "keep storage"
    PAGES = "pages"  # kept, computed on the mapped shard itself: its resident pages dropped


def release_rule(
    moment: Moment,
    unit: Unit,
    *,
    last_backward: bool,
    reshard_after_backward: bool,
    training: bool = True,
    kept: bool = False,
    landed: bool = False,
) -> Release:
    """What ``unit`` gives up at ``moment``: [Note: the free rule].

    ``training``: the forward ran with grad enabled; ``kept``: the schedule keeps the unit
    gathered after forward; ``landed``: the end of backward just waited for a gather
    nobody used; ``last_backward``/``reshard_after_backward``: [Note: microbatched steps].
    """
    release = _release(
        moment,
        unit,
        last_backward=last_backward,
        reshard_after_backward=reshard_after_backward,
        training=training,
        kept=kept,
        landed=landed,
    )
    if release is Release.FREE and unit.keeps_full_storage:
        return Release.KEEP_STORAGE
    return release


def _release(
    moment: Moment,
    unit: Unit,
    *,
    last_backward: bool,
    reshard_after_backward: bool,
    training: bool,
    kept: bool,
    landed: bool,
) -> Release:
    handle = unit.handle
    if handle is None:
        return Release.KEEP
    frees = unit.strategy.free_after_backward  # False: ZeRO-1 and NO_SHARD keep the buffer
    free_or_show = Release.FREE if frees else Release.SHOW_SHARD
    if moment is Moment.POST_FORWARD:
        if unit.state is TrainingState.BACKWARD or unit.forward_depth > 0:
            return Release.KEEP  # a forward re-run in backward, or a nested one
        if not training and not unit.no_grad_follows_reshard_setting:
            return free_or_show
        if unit.reshard_after_forward and not (kept and training):
            return free_or_show
        if unit.strategy.reduces_at_step:
            return Release.SHOW_SHARD
        return Release.KEEP if handle.separate_full else Release.PAGES
    if moment is Moment.ABANDONED:
        if not frees or (unit.no_grad_follows_reshard_setting and not unit.reshard_after_forward):
            return Release.KEEP
        return Release.FREE if last_backward else Release.SHOW_SHARD
    if moment is Moment.USER_CALL:
        return free_or_show
    if moment is Moment.POST_BACKWARD:
        return Release.FREE if frees and reshard_after_backward else Release.SHOW_SHARD
    if landed:
        return free_or_show if last_backward else Release.SHOW_SHARD
    if last_backward and frees and reshard_after_backward and handle.full_storage_bytes:
        return Release.FREE  # gathered by a bucket, then not used this step
    return Release.KEEP
