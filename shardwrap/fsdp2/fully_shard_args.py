"""``fully_shard``'s arguments, parsed into what the engine acts on; everything else refused.

torch's own option records (``MixedPrecisionPolicy``, ``OffloadPolicy``) are the defaults,
so ``fully_shard``'s signature is torch's. A policy asking for what the engine cannot do
as FSDP2 does is refused with its name and what to do, never silently dropped.

[Note: FSDP2's mixed precision on the engine]
Each call's ``MixedPrecisionPolicy`` becomes the engine's ``MixedPrecision`` for that
call's unit (``core/precision.py``: gather in ``param_dtype``, reduce in ``reduce_dtype``,
gradients back in the master dtype), so every call may carry its own policy, as in FSDP2.
FSDP2 casts the floating forward inputs of every module it was called on, the root
included, when ``cast_forward_inputs`` is set *and* ``param_dtype`` is not None
(``FSDPState._cast_forward_inputs``): ``cast_forward_inputs`` and
``cast_root_forward_inputs`` both take the policy's flag, and the engine skips the casts
without a ``param_dtype`` as FSDP2 does. FSDP2 knows no full-precision module classes
(FSDP1's BatchNorm exception): ``module_classes_to_ignore`` is empty. ``output_dtype`` is
the door's own forward hook (``fully_shard.py``).

A reduction in float16: FSDP2 divides each rank's gradient by about the square root of
the divisor before the reduce-scatter and the sum by the rest after it, both in float16
(overflow risk); the door's units do the same ([Note: float16 reductions divided around
the sum] in ``core/grad_division.py``; ``fully_shard._adopt_unit``). In fp32 and bf16 FSDP2
divides once, by the world size, in the reduce dtype (AVG); the engine divides once too,
but after the cast to the master dtype, which is the same at 2 ranks (a division by 2 is
exact) and may differ by a bf16 rounding at other world sizes.

[Note: FSDP2's CPU offload on the engine]
FSDP2's ``CPUOffloadPolicy`` keeps a call's sharded parameters (so the DTensors'
local tensors, the gradients and the optimizer's state and step) in host memory, copying
each shard to the mesh's device before the all-gather and each reduced gradient back
(``FSDPParam``, ``foreach_reduce``); ``pin_memory`` pins those host tensors, which
without an accelerator fails in torch (``Tensor.pin_memory``). Each call's policy becomes
the engine's ``CPUOffload(offload_params=True, pin_memory=...)`` for that call's unit
([Note: host shards and staging] in ``offload/host.py``); pin_memory=True without CUDA is
refused naming it. The engine computes on the parameters' device, which FSDP2 requires
to be the CPU under offload, so only a CPU mesh is accepted (``check_offload_mesh``).

[Note: FSDP2's reshard to a smaller world]
``reshard_after_forward=k`` (an int) asks FSDP2 to keep, after forward, a 1/k share of the
gathered parameters on each rank of a group of k consecutive ranks of the shard mesh
(``mesh.view(-1, k)``), so backward all-gathers inside that group instead of the whole
shard group; k must divide the shard mesh's size; k equal to it is True, and k = 1 is
False (torch warns that it means no resharding). That is the engine's hpZ: the unit's
``CommQuantization(hpz_partition_size=k)`` keeps the same share (its secondary shard) of
the same consecutive ranks and gathers it back in backward, moving the same bytes. The
values an all-gather returns do not depend on the group, so the numbers are FSDP2's.

[Note: FSDP2's ignored_params]
FSDP2 leaves a call's ``ignored_params`` as they are: plain parameters (no DTensors), not
sharded, not moved to the mesh's device, their gradients not reduced (each rank keeps its
own; ``_get_managed_states`` skips them). A later call on an ancestor does not take them
either: its search stops at modules a call already sharded. The engine leaves out
parameters by identity (``WrapOptions.ignored_params``), so the door passes each call's
set, and the parameters a nested call left out (``fully_shard._left_out_below``).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from ..base.torch_compat import fsdp2_reduces_in_param_dtype_by_default
from ..base.validate import check_bool
from ..options import CPUOffload, MixedPrecision

NOT_YET = "is not yet supported by shardwrap.fully_shard"


@dataclass(frozen=True, slots=True)
class UnitOptions:
    """What one ``fully_shard`` call asks of its unit."""

    # True/False as given; None: FSDP2's default, decided once the root is known
    # (False for the root, which backward needs first, True for every other unit); an int
    # until the mesh is known (``resolve_reshard_size``).
    reshard_after_forward: bool | int | None
    # Resharded after forward to groups of this many ranks ([Note: FSDP2's reshard to a
    # smaller world]); None: to the whole shard group, or not at all.
    reshard_group_size: int | None = None
    # The engine's record of mp_policy ([Note: FSDP2's mixed precision on the engine]);
    # None: the default policy (compute, gather and reduce in the parameters' dtype).
    mixed_precision: MixedPrecision | None = None
    output_dtype: torch.dtype | None = None  # floating outputs cast to it after forward
    # The engine's record of offload_policy ([Note: FSDP2's CPU offload on the engine]);
    # None: OffloadPolicy() (no offload).
    cpu_offload: CPUOffload | None = None
    # Parameters the call leaves unsharded and unmanaged ([Note: FSDP2's ignored_params]).
    ignored_params: frozenset[nn.Parameter] = frozenset()


def parse_options(
    *,
    reshard_after_forward: object,
    shard_placement_fn: object,
    mp_policy: object,
    offload_policy: object,
    ignored_params: object,
    master_dtype: torch.dtype = torch.float32,
) -> UnitOptions:
    """Check ``fully_shard``'s keyword arguments (errors name the argument)."""
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise TypeError(
            "reshard_after_forward: expected a bool, an int (the group size to reshard to) "
            f"or None, got {reshard_after_forward!r}"
        )
    if shard_placement_fn is not None:
        raise ValueError(
            f"shard_placement_fn {NOT_YET}: parameters are sharded on dim 0 (Shard(0)); pass None"
        )
    mixed_precision, output_dtype = _parse_mp_policy(mp_policy, master_dtype)
    cpu_offload = _parse_offload_policy(offload_policy)
    ignored = _parse_ignored_params(ignored_params)
    return UnitOptions(
        reshard_after_forward=reshard_after_forward,  # type: ignore[arg-type]
        mixed_precision=mixed_precision,
        output_dtype=output_dtype,
        cpu_offload=cpu_offload,
        ignored_params=ignored,
    )


def _parse_mp_policy(
    mp_policy: object, master_dtype: torch.dtype
) -> tuple[MixedPrecision | None, torch.dtype | None]:
    """``mp_policy`` as the engine's ``MixedPrecision`` and the output dtype ([Note:
    FSDP2's mixed precision on the engine])."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy: expected a MixedPrecisionPolicy, got {type(mp_policy).__name__}"
        )
    output_dtype = mp_policy.output_dtype
    if output_dtype is not None and not (
        isinstance(output_dtype, torch.dtype) and output_dtype.is_floating_point
    ):
        raise ValueError(f"mp_policy.output_dtype: expected a floating dtype, got {output_dtype!r}")
    if mp_policy.reduce_dtype is None and mp_policy.param_dtype is None:
        return None, output_dtype  # no casts (FSDP2 casts inputs only to a param_dtype)
    reduce_dtype = mp_policy.reduce_dtype
    if reduce_dtype is None and not fsdp2_reduces_in_param_dtype_by_default():
        reduce_dtype = master_dtype  # torch >= 2.15: the parameters' own dtype
    try:
        policy = MixedPrecision(
            param_dtype=mp_policy.param_dtype,
            reduce_dtype=reduce_dtype,
            cast_forward_inputs=mp_policy.cast_forward_inputs,
            cast_root_forward_inputs=mp_policy.cast_forward_inputs,
            module_classes_to_ignore=(),
        )
    except (TypeError, ValueError) as error:
        raise type(error)(f"mp_policy.{error}") from None
    return policy, output_dtype


def _parse_offload_policy(offload_policy: object) -> CPUOffload | None:
    """``offload_policy`` as the engine's ``CPUOffload`` ([Note: FSDP2's CPU offload on
    the engine]); None: no offload."""
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy: expected an OffloadPolicy, got {type(offload_policy).__name__}"
        )
    if not isinstance(offload_policy, CPUOffloadPolicy):
        return None
    pin_memory = check_bool("offload_policy.pin_memory", offload_policy.pin_memory)
    if pin_memory and not torch.cuda.is_available():
        raise ValueError(
            f"offload_policy={offload_policy}: pin_memory=True needs CUDA and "
            "torch.cuda.is_available() is False (torch's FSDP2 fails there too, pinning "
            "the shards); pass CPUOffloadPolicy(pin_memory=False)"
        )
    return CPUOffload(offload_params=True, pin_memory=pin_memory)


def _parse_ignored_params(ignored_params: object) -> frozenset[nn.Parameter]:
    """``ignored_params`` (None or a set of parameters) as a frozenset."""
    if ignored_params is None:
        return frozenset()
    if not isinstance(ignored_params, (set, frozenset, list, tuple)) or not all(
        isinstance(p, torch.Tensor) for p in ignored_params
    ):
        raise TypeError(
            f"ignored_params: expected None or a set of nn.Parameter, got {ignored_params!r}"
        )
    return frozenset(ignored_params)


def check_offload_mesh(options: UnitOptions, mesh_device_type: str) -> None:
    """Refuse CPU offload where the engine would not compute where FSDP2 does: FSDP2
    gathers a host shard onto its mesh's device, the engine computes on the device the
    parameters are on, which CPU offload requires to be the CPU."""
    if options.cpu_offload is not None and mesh_device_type != "cpu":
        raise ValueError(
            f"offload_policy=CPUOffloadPolicy() with a {mesh_device_type!r} mesh {NOT_YET} "
            "(only a CPU mesh); use shardwrap.ShardedModule(cpu_offload="
            "CPUOffload(offload_params=True)) for host shards with accelerator compute"
        )


def resolve_reshard_size(options: UnitOptions, shard_size: int) -> UnitOptions:
    """``options`` with an int ``reshard_after_forward`` settled against the shard mesh's
    size ``shard_size`` ([Note: FSDP2's reshard to a smaller world])."""
    size = options.reshard_after_forward
    if size is None or isinstance(size, bool):
        return options
    if size < 1 or size > shard_size or shard_size % size:
        raise ValueError(
            f"reshard_after_forward={size}: an int must be a factor of {shard_size} (the "
            "shard mesh's size): the size of the groups to reshard to"
        )
    if size == 1:
        warnings.warn(
            "reshard_after_forward=1 (an int) keeps the gathered parameters after forward, "
            "as reshard_after_forward=False does; pass False",
            stacklevel=3,
        )
        return dataclasses.replace(options, reshard_after_forward=False)
    if size == shard_size:
        return dataclasses.replace(options, reshard_after_forward=True)
    return dataclasses.replace(options, reshard_after_forward=True, reshard_group_size=size)
