"""A user's all-gather and reduce-scatter objects (FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``), issued in a unit's place of shardwrap's own.

[Note: user communicators]
FSDP2's comm protocol (``AllGather`` / ``ReduceScatter`` in torch's ``_fsdp_api``) is an
object with ``allocate(size, *, dtype, device)`` and a ``__call__`` taking
``output_tensor``, ``input_tensor`` and ``group`` (an all-gather also ``async_op``, a
reduce-scatter also ``op``). FSDP2 allocates the gather's output (``(world * shard
numel,)``, the gather dtype) and the reduce-scatter's input (``(world * shard numel,)``)
and output (``(shard numel,)``, both the reduce dtype) with the object's ``allocate``, then
calls it with those keywords; at a world of one it calls neither (torch 2.13 and 2.15
alike). A unit here does the same with its own buffers (1D, rank order: rank ``r``'s
shard at ``[r * n, (r + 1) * n)``; the gathered buffer is then copied into the unit's
full buffer in parameter order, as every dim-0 chunk gather is), its collectives alone
(never in a gather or reduce bucket), over its shard group (under HSDP the replica
all-reduce stays the engine's, as FSDP2's stays its own), with these differences:

* the shard's element order is the door's dim-0 chunk layout ([Note: the dim-0 chunk
  layout] in layout/chunks.py): every parameter's chunk end to end, the padding at the
  shard's end, where FSDP2 pads each parameter's chunk; sizes and rank 0's order agree;
* a reduce-scatter is passed ``op=ReduceOp.SUM`` (shardwrap divides before and after the
  sum itself, as FSDP2 does with ``set_force_sum_reduction_for_comms(True)``);
* both are passed ``async_op=True``: the engine issues them ahead and waits on the
  returned ``Work`` when it needs the result (``None``: done when the call returned).

Only those two use the objects: state dicts and DTensor's ``full_tensor()`` do not, as
under FSDP2. The object is the user's
code: it may call ``torch.distributed`` itself. Each call is
recorded in the ledger as the collective it stands for (kind, purpose, the full buffer's
bytes), checked first by a collective checker when one is set, as any other; what the
object actually moves over the wire is its own business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .collectives import Communicator


@dataclass(frozen=True, slots=True)
class UserComms:
    """A unit's user objects; None: its shard communicator's own collective."""

    all_gather: Any = None  # FSDP2's AllGather protocol: the parameter all-gathers
    reduce_scatter: Any = None  # FSDP2's ReduceScatter protocol: the gradient reduce-scatter


def check_user_comm(name: str, comm: object) -> Any:
    """``comm`` if it follows the protocol (callable, with a callable ``allocate``)."""
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{name}: expected a communicator object (callable, with "
            f"allocate(size, *, dtype, device)), got {type(comm).__name__}"
        )
    return comm


def allocate(comm: Any, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1D buffer of ``numel`` elements from the object's ``allocate``, as FSDP2 asks it."""
    buffer = comm.allocate((numel,), dtype=dtype, device=device)
    if not isinstance(buffer, torch.Tensor) or buffer.numel() != numel:
        raise TypeError(
            f"{type(comm).__name__}.allocate: expected a tensor of {numel} elements, got "
            f"{getattr(buffer, 'shape', type(buffer).__name__)}"
        )
    if buffer.dtype != dtype or buffer.device != device:
        raise TypeError(
            f"{type(comm).__name__}.allocate: expected {dtype} on {device}, got "
            f"{buffer.dtype} on {buffer.device}"
        )
    return buffer.view(-1)


def _checked(kind: str, comm: Any, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` whose result must be None or waitable: refused at once, not at the wait."""

    def run() -> Any:
        work = call()
        if work is not None and not callable(getattr(work, "wait", None)):
            raise TypeError(
                f"{type(comm).__name__} ({kind}) returned a {type(work).__name__}; expected "
                "None or a torch.distributed Work (something with wait())"
            )
        return work

    return run


def gather_params(group: Communicator, comm: Any, shard: torch.Tensor, numel: int, *, unit: str):
    """Issue ``comm``'s gather of every rank's ``shard`` into a buffer of ``numel`` from its
    ``allocate``: (a waitable, that buffer). Recorded as a parameter all-gather."""
    out_full = allocate(comm, numel, shard.dtype, shard.device)
    work = group.run_user(
        "all_gather",
        "params",
        out_full,
        unit,
        _checked(
            "all_gather",
            comm,
            lambda: comm(
                output_tensor=out_full, input_tensor=shard, group=group.group, async_op=True
            ),
        ),
    )
    return work, out_full


def reduce_scatter_grads(
    group: Communicator,
    comm: Any,
    take_local_grads: Callable[[torch.Tensor], torch.Tensor],
    numels: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    unit: str,
):
    """Issue ``comm``'s reduce-scatter of the local gradients (``take_local_grads`` fills
    the input buffer) into this rank's chunk; both buffers, of ``numels`` (input, output),
    from its ``allocate``: (a waitable, the chunk, the input). Recorded as a gradient
    reduce-scatter."""
    in_full = take_local_grads(allocate(comm, numels[0], dtype, device))
    out_shard = allocate(comm, numels[1], dtype, device)

    def call():
        op = dist.ReduceOp.SUM
        return comm(
            output_tensor=out_shard, input_tensor=in_full, group=group.group, op=op, async_op=True
        )

    work = group.run_user(
        "reduce_scatter", "grads", in_full, unit, _checked("reduce_scatter", comm, call)
    )
    return work, out_shard, in_full
