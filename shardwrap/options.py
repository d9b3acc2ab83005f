"""Public enums and option records, named as in ``torch.distributed.fsdp``."""

from __future__ import annotations

import enum
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from .base.quantize import BlockCodec
from .base.records import as_record, equals_torch_member, equals_torch_record
from .base.validate import check_bools, check_int

_E = TypeVar("_E", bound=enum.Enum)


class ShardingStrategy(enum.Enum):
    """What each rank keeps of parameters, gradients and optimizer state.

    ============================  ==========  =========  ===============
    member                        parameters  gradients  optimizer state
    ============================  ==========  =========  ===============
    ``FULL_SHARD`` (ZeRO-3)       sharded     sharded    sharded
    ``SHARD_GRAD_OP`` (ZeRO-2)    full in fwd sharded    sharded
    ``SHARD_OPTIM`` (ZeRO-1)      full        full       sharded
    ``NO_SHARD`` (data parallel)  full        full       full
    ``HYBRID_SHARD``              ZeRO-3 inside a shard group, replicated across groups
    ``HYBRID_SHARD_ZERO2``        ZeRO-2 inside a shard group, replicated across groups
    ============================  ==========  =========  ===============
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    SHARD_OPTIM = "SHARD_OPTIM"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    __eq__ = equals_torch_member  # torch's member of the same name is equal (base/records.py)
    __hash__ = enum.Enum.__hash__

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def reshard_after_forward(self) -> bool:
        """Free the gathered parameters after forward (re-gather them in backward)."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    @property
    def free_after_backward(self) -> bool:
        """Free the gathered parameters once the unit's gradients are reduced."""
        return self not in (ShardingStrategy.SHARD_OPTIM, ShardingStrategy.NO_SHARD)

    @property
    def reduces_at_step(self) -> bool:
        """Gradients left by ``no_sync`` backwards are reduced at the optimizer step (ZeRO-1).

        Synchronising backwards reduce ZeRO-1 gradients as they go, like ZeRO-2's; see
        [Note: ZeRO-1 reduces in backward] in ``runtime/deferred_grads.py``.
        """
        return self is ShardingStrategy.SHARD_OPTIM

    @classmethod
    def parse(cls, value: object) -> ShardingStrategy:
        """Accept our member, torch's ``ShardingStrategy`` member, or a name."""
        if value is None:
            return cls.FULL_SHARD
        member = _parse_member(cls, value, strip_underscores=True)
        if member is not None:
            return member
        allowed = ", ".join(cls.__members__)
        raise ValueError(f"sharding_strategy: unknown strategy {value!r}; allowed: {allowed}")


class BackwardPrefetch(enum.Enum):
    """When to issue the next unit's all-gather during backward."""

    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"

    __eq__ = equals_torch_member  # torch's member of the same name is equal (base/records.py)
    __hash__ = enum.Enum.__hash__

    @classmethod
    def parse(cls, value: object) -> BackwardPrefetch | None:
        if value is None:
            return None
        member = _parse_member(cls, value)
        if member is not None:
            return member
        allowed = ", ".join(cls.__members__)
        raise ValueError(f"backward_prefetch: unknown value {value!r}; allowed: None, {allowed}")


@dataclass(frozen=True, slots=True)
class CPUOffload:
    """Keep parameter shards in host memory (a no-op when the model already lives on CPU)."""

    offload_params: bool = False
    # Page-locked host shards; None: pinned when CUDA is available (FSDP1's way). The
    # FSDP2 door sets it from CPUOffloadPolicy.pin_memory.
    pin_memory: bool | None = None

    __eq__ = equals_torch_record  # torch's record of the same name too (base/records.py)

    def __post_init__(self) -> None:
        if not isinstance(self.offload_params, bool):
            raise TypeError(f"offload_params must be a bool, got {type(self.offload_params)}")
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool or None, got {type(self.pin_memory)}")


# [Note: keep_low_precision_grads]
# FSDP1 can leave gradients in param_dtype after backward. shardwrap always reduces them in
# reduce_dtype and hands them to the optimizer in the master (parameter) dtype, which is
# what an fp32 optimizer step casts to anyway: results are at least as precise, and the
# gradient shards take master-dtype memory. True is accepted with this warning.
KEEP_LOW_PRECISION_GRADS = (
    "MixedPrecision(keep_low_precision_grads=True): shardwrap hands gradients to the "
    "optimizer in the parameter (master) dtype; they are not kept in param_dtype"
)

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class MixedPrecision:
    """Dtypes for computation, gradient reduction and buffers (``None``: leave as is).

    The shard always keeps the parameters' own dtype (fp32 master weights) and the
    optimizer updates it; see ``[Note: mixed-precision data flow]`` in
    ``shardwrap/core/precision.py``.
    """

    param_dtype: torch.dtype | None = None  # gathered parameters, forward/backward compute
    reduce_dtype: torch.dtype | None = None  # gradient collectives (default: param_dtype)
    buffer_dtype: torch.dtype | None = None  # module buffers, cast once at wrap time
    keep_low_precision_grads: bool = False  # accepted; grads stay in the master dtype
    cast_forward_inputs: bool = False  # every unit casts its floating inputs to param_dtype
    cast_root_forward_inputs: bool = True  # the root casts its floating inputs
    # These modules compute in full precision (own unit, inputs cast up, outputs back).
    module_classes_to_ignore: Sequence[type[nn.Module]] = (nn.modules.batchnorm._BatchNorm,)

    __eq__ = equals_torch_record  # torch's record of the same name too (base/records.py)

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOAT_DTYPES:
                allowed = ", ".join(str(d) for d in _FLOAT_DTYPES)
                raise ValueError(f"{name}: expected None or one of {allowed}, got {value!r}")
        for name in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.keep_low_precision_grads:  # accepted, see [Note: keep_low_precision_grads]
            warnings.warn(KEEP_LOW_PRECISION_GRADS, UserWarning, stacklevel=3)
        classes = self.module_classes_to_ignore
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(
                f"module_classes_to_ignore: expected nn.Module subclasses, got {classes!r}"
            )

    @classmethod
    def parse(cls, value: object) -> MixedPrecision | None:
        """Accept ``None``, our ``MixedPrecision`` or torch's FSDP ``MixedPrecision``."""
        if value is None or isinstance(value, cls):
            return value
        if type(value).__name__ == cls.__name__:  # torch's, field by field
            return as_record("mixed_precision", value, cls)
        raise TypeError(f"mixed_precision: expected MixedPrecision or None, got {value!r}")


class StateDictType(enum.Enum):
    """What ``ShardedModule.state_dict()`` returns (FSDP's names).

    ``FULL_STATE_DICT`` (the default): whole tensors under the unwrapped model's names.
    ``SHARDED_STATE_DICT``: ``DTensor``s (dim-0 chunks over the shard group; whole tensors
    where a unit is not sharded) under the same names, which ``torch.distributed.checkpoint``
    reshards; see [Note: DTensor state dicts] in ``ckpt/dtensor_state.py``.
    """

    FULL_STATE_DICT = "FULL_STATE_DICT"
    SHARDED_STATE_DICT = "SHARDED_STATE_DICT"

    __eq__ = equals_torch_member  # torch's member of the same name is equal (base/records.py)
    __hash__ = enum.Enum.__hash__

    @classmethod
    def parse(cls, value: object) -> StateDictType:
        """Accept our member, torch's ``StateDictType`` member, or a name."""
        member = _parse_member(cls, value)
        if member is not None:
            return member
        allowed = ", ".join(cls.__members__)
        raise ValueError(f"state_dict_type: unsupported value {value!r}; allowed: {allowed}")


def _parse_member(cls: type[_E], value: object, *, strip_underscores: bool = False) -> _E | None:
    """The member of ``cls`` that ``value`` names, or ``None`` when it names none.

    ``value`` may be a member of ``cls``, a member of another enum with the same name
    (torch's), or the name as a string (any case; ``strip_underscores``: leading ``_``
    ignored).
    """
    if isinstance(value, cls):
        return value
    name = value.name if isinstance(value, enum.Enum) else value
    if not isinstance(name, str):
        return None
    key = name.upper().lstrip("_") if strip_underscores else name.upper()
    return cls.__members__.get(key)


@dataclass(frozen=True, slots=True)
class FullStateDictConfig:
    """Options of ``FULL_STATE_DICT``.

    ``offload_to_cpu``: return tensors in host memory. ``rank0_only``: only world rank 0
    gets the state dict (the others take part in the gathers and get ``{}``).
    """

    offload_to_cpu: bool = False
    rank0_only: bool = False

    def __post_init__(self) -> None:
        check_bools(self, "offload_to_cpu", "rank0_only")


@dataclass(frozen=True, slots=True)
class ShardedStateDictConfig:
    """Options of ``SHARDED_STATE_DICT``: ``offload_to_cpu`` returns host-memory copies."""

    offload_to_cpu: bool = False

    def __post_init__(self) -> None:
        check_bools(self, "offload_to_cpu")


@dataclass(frozen=True, slots=True)
class DiskOffload:
    """Keep fp32 master shards, their gradients and Adam/AdamW state in mapped files in ``path``.

    Pass it as ``ShardedModule(..., cpu_offload=DiskOffload(path))``; see
    :mod:`shardwrap.offload.disk`. ``path`` must be an existing, writable directory.
    ``sub_group_size``: the most shard elements the optimizer steps before their pages
    are released (DeepSpeed's ``sub_group_size``; its default, 1e9, is in practice one
    group), which bounds the resident memory of a step; see :mod:`shardwrap.offload.disk_step`.
    """

    path: str
    sub_group_size: int = 1_000_000_000

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise TypeError(f"DiskOffload: path must be a non-empty str, got {self.path!r}")
        check_int("DiskOffload: sub_group_size", self.sub_group_size, minimum=1)


@dataclass(frozen=True, slots=True)
class CommQuantization:
    """ZeRO++'s three ways to move fewer bytes, each off unless asked for (``docs/zeropp.md``).

    * ``weights`` (qwZ): every parameter all-gather of a sharded unit (forward, backward,
      a checkpoint's recompute) sends its shard block-quantized to ``weight_bits``; every
      rank dequantizes into the compute dtype, so all of them compute with the same
      weights. The shard (master weights) and the optimizer never see quantized values.
    * ``gradients`` (qgZ): the reduce-scatter of a sharded unit's gradients becomes an
      all-to-all of block-quantized slices (``gradient_bits``, 8 or 4), dequantized and
      summed in fp32.
    * ``hpz_partition_size`` (hpZ): after forward each sharded unit keeps a secondary
      shard of its gathered parameters over groups of this many consecutive ranks of its
      shard group, and the backward all-gather runs inside that group. ``1`` (DeepSpeed's
      default) turns it off; it must divide the shard group's size.

    ``block_size``: values per fp32 scale (even, >= 2).
    """

    weights: bool = False
    weight_bits: int = 8
    gradients: bool = False
    gradient_bits: int = 8
    block_size: int = 256
    hpz_partition_size: int = 1

    def __post_init__(self) -> None:
        check_bools(self, "weights", "gradients")
        for name in ("weight_bits", "gradient_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in (8, 4):
                raise ValueError(f"{name}: expected 8 or 4, got {value!r}")
        check_int("block_size", self.block_size, minimum=2)
        if self.block_size % 2:
            raise ValueError(f"block_size: must be even, got {self.block_size}")
        check_int("hpz_partition_size", self.hpz_partition_size, minimum=1, meaning="1 is off")

    @property
    def enabled(self) -> bool:
        return self.weights or self.gradients or self.hpz_partition_size > 1

    @property
    def weight_codec(self) -> BlockCodec | None:
        return BlockCodec(self.weight_bits, self.block_size) if self.weights else None

    @property
    def gradient_codec(self) -> BlockCodec | None:
        return BlockCodec(self.gradient_bits, self.block_size) if self.gradients else None

    @classmethod
    def parse(cls, value: object) -> CommQuantization | None:
        """Accept ``None`` or a ``CommQuantization``."""
        if value is None or isinstance(value, cls):
            return value
        raise TypeError(f"comm_quantization: expected CommQuantization or None, got {value!r}")
