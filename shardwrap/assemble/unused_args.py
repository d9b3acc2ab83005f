"""FSDP1 constructor arguments that ``ShardedModule`` accepts and does not act on.

[Note: FSDP1 arguments not acted on]
``ShardedModule`` takes FSDP1's signature so that scripts run unchanged. Two of its
arguments ask for something shardwrap always does or cannot do, and a third is only
used in one case; each warns once per process when it asks for something else
([Note: accepted but not acted on] in ``base/warn_once.py``):

* ``limit_all_gathers``: FSDP1's rate limit on all-gathers its CPU thread issues ahead.
  shardwrap's schedule decides how far gathers run ahead whatever the flag says
  ([Note: prefetch and overlap] in ``runtime/schedule.py``: one unit, one all-gather
  bucket, or the run of units that stay gathered until backward anyway), which bounds
  them as ``True`` (the default) asks. It changes no collective, so ranks may differ in it.
* ``use_orig_params=False``: FSDP1 then shows flat parameters. shardwrap always shows the
  original parameters (as views of this rank's shard), which is what ``True`` asks for.
* ``param_init_fn`` on a module with no tensor on the meta device: it is not called (as
  in FSDP1, which calls it only for meta or fake tensors); the module's values are used.
"""

from __future__ import annotations

from ..base.warn_once import warn_once


def note_unused_args(*, limit_all_gathers: bool, use_orig_params: bool) -> None:
    """Warn once for each of FSDP1's arguments set to a value shardwrap does not act on."""
    if not limit_all_gathers:
        warn_once(
            "ShardedModule(limit_all_gathers=False)",
            "not acted on: shardwrap's schedule sets how far all-gathers run ahead (one "
            "unit, one all-gather bucket, or the units that stay gathered until backward "
            "anyway), bounded as with the default limit_all_gathers=True",
        )
    if not use_orig_params:
        warn_once(
            "ShardedModule(use_orig_params=False)",
            "not acted on: shardwrap always shows the original parameters (views of this "
            "rank's shard), as use_orig_params=True does; there are no flat parameters",
        )


def note_param_init_fn_unused() -> None:
    """``param_init_fn`` given for a module with nothing on the meta device."""
    warn_once(
        "ShardedModule(param_init_fn=...)",
        "not called: the module has no tensor on the meta device, so its own values are "
        "sharded (as in FSDP1); build it under torch.device('meta') to initialise it unit by "
        "unit",
    )
