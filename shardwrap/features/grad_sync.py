"""FSDP2's microbatch controls: gradient sync, resharding after backward, last backward.

Pipeline schedules (and hand-written gradient accumulation) run several backwards per
optimizer step. FSDP2 lets them say so with ``set_requires_gradient_sync``,
``set_reshard_after_backward`` and ``set_is_last_backward``; ``ShardedModule`` answers the
same calls, with the same meaning, for all units of its root at once (see
[Note: microbatched steps] in ``runtime/step.py``). ``no_sync()`` is the context-manager
form of ``set_requires_gradient_sync(False)``. Each function takes the root it sets.
"""

from __future__ import annotations

from ..assemble.root import ShardRoot
from ..base.validate import check_bool


def _check_recurse(method: str, recurse: object) -> None:
    if not check_bool("recurse", recurse):
        raise ValueError(
            f"{method}: recurse=False is not supported; a ShardedModule root sets this for "
            "all its units at once"
        )


def set_requires_gradient_sync(
    root: ShardRoot, requires_gradient_sync: bool, *, recurse: bool = True
) -> None:
    """Whether backward reduces gradients (``False``: accumulate locally, as ``no_sync``).

    The first backward with sync on reduces everything accumulated since the last
    reduction, once per unit.
    """
    value = check_bool("requires_gradient_sync", requires_gradient_sync)
    _check_recurse("set_requires_gradient_sync", recurse)
    root.runtime.sync_grads = value


def set_reshard_after_backward(
    root: ShardRoot, reshard_after_backward: bool, *, recurse: bool = True
) -> None:
    """Whether units free their gathered parameters after backward (default ``True``).

    ``False`` keeps them gathered, so the next microbatch's backward (and its forward,
    with ``set_reshard_after_forward(False, root_only=False)``) gathers nothing: one
    all-gather per unit and step instead of one per microbatch, at the cost of the
    full parameters in memory. Strategies that never free (ZeRO-1/2) are unaffected.
    """
    value = check_bool("reshard_after_backward", reshard_after_backward)
    _check_recurse("set_reshard_after_backward", recurse)
    root.runtime.reshard_after_backward = value


def set_is_last_backward(root: ShardRoot, is_last_backward: bool) -> None:
    """Whether the next backward ends the step (default ``True``).

    ``False``: more microbatches follow, so a new forward keeps what earlier ones left
    gathered, and the end of that backward does not free kept units.
    """
    root.runtime.is_last_backward = check_bool("is_last_backward", is_last_backward)
