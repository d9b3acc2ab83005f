"""``set_custom_all_gather`` / ``set_custom_reduce_scatter`` on the FSDP2 door.

As FSDP2 sets the object on the module's own parameter group (not the groups below),
the object is set on the module's own unit: its parameter all-gathers and its gradient
reduce-scatter are then the object's calls, with the unit's buffers ([Note: user
communicators] in ``comm/user_comms.py`` says what it is given and how that differs from
FSDP2's). A unit without parameters communicates nothing, so the object is kept by
nobody, as under FSDP2. Refused where the unit's collectives are not the plain shard
group's one gather and one reduce-scatter.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from ..comm.user_comms import check_user_comm
from .state import unit_of


def _refuse(method: str, unit: str, why: str) -> None:
    raise NotImplementedError(
        f"FSDPModule.{method} is not yet supported by shardwrap for unit {unit!r}: {why}"
    )


def set_all_gather(module: nn.Module, comm: Any) -> None:
    """``module``'s unit gathers its parameters with ``comm`` from now on."""
    comm = check_user_comm("comm", comm)
    handle = unit_of(module).handle
    if handle is None:
        return
    quant = handle.comm_quant
    if quant is not None and quant.hpz_comm is not None:
        _refuse(
            "set_custom_all_gather",
            handle.comm_label,
            "its reshard_after_forward is an int, so its backward gathers a kept "
            "secondary shard over a smaller group; use reshard_after_forward=True or False",
        )
    if quant is not None and quant.weight_codec is not None:  # defensive: the door makes
        # no qwZ units today, but a handle's gathers quantized would bypass the object
        _refuse("set_custom_all_gather", handle.comm_label, "its gathers are quantized (qwZ)")
    handle.user_comms = replace(handle.user_comms, all_gather=comm)


def set_reduce_scatter(module: nn.Module, comm: Any) -> None:
    """``module``'s unit reduce-scatters its gradients with ``comm`` from now on."""
    comm = check_user_comm("comm", comm)
    handle = unit_of(module).handle
    if handle is None:
        return
    if handle.grads.grad_codec is not None:  # defensive, as for qwZ above
        _refuse(
            "set_custom_reduce_scatter", handle.comm_label, "its reductions are quantized (qgZ)"
        )
    handle.user_comms = replace(handle.user_comms, reduce_scatter=comm)
