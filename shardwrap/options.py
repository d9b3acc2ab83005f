"""Public enums and option records, named as in ``torch.distributed.fsdp``."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
        """Gradients stay full and local until the optimizer steps (ZeRO-1)."""
        return self is ShardingStrategy.SHARD_OPTIM

    @classmethod
    def parse(cls, value: object) -> ShardingStrategy:
        """Accept our member, torch's ``ShardingStrategy`` member, or a name."""
        if value is None:
            return cls.FULL_SHARD
        if isinstance(value, cls):
            return value
        name = value.name if isinstance(value, enum.Enum) else value
        if isinstance(name, str):
            key = name.upper().lstrip("_")
            if key in cls.__members__:
                return cls[key]
        allowed = ", ".join(cls.__members__)
        raise ValueError(f"sharding_strategy: unknown strategy {value!r}; allowed: {allowed}")


class BackwardPrefetch(enum.Enum):
    """When to issue the next unit's all-gather during backward."""

    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"

    @classmethod
    def parse(cls, value: object) -> BackwardPrefetch | None:
        if value is None or isinstance(value, cls):
            return value
        name = value.name if isinstance(value, enum.Enum) else value
        if isinstance(name, str) and name.upper() in cls.__members__:
            return cls[name.upper()]
        allowed = ", ".join(cls.__members__)
        raise ValueError(f"backward_prefetch: unknown value {value!r}; allowed: None, {allowed}")


@dataclass(frozen=True, slots=True)
class CPUOffload:
    """Keep parameter shards in host memory (a no-op when the model already lives on CPU)."""

    offload_params: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.offload_params, bool):
            raise TypeError(f"offload_params must be a bool, got {type(self.offload_params)}")


class StateDictType(enum.Enum):
    """What ``ShardedModule.state_dict()`` returns (FSDP's names).

    ``FULL_STATE_DICT`` (the default): whole tensors under the unwrapped model's names.
    ``SHARDED_STATE_DICT``: this rank's pieces (1-D slices of the flattened originals, or
    whole tensors where a unit is not sharded) under the same names; they load back only
    into the same world size and strategy. Use ``shardwrap.checkpoint`` to reshard.
    """

    FULL_STATE_DICT = "FULL_STATE_DICT"
    SHARDED_STATE_DICT = "SHARDED_STATE_DICT"

    @classmethod
    def parse(cls, value: object) -> StateDictType:
        """Accept our member, torch's ``StateDictType`` member, or a name."""
        if isinstance(value, cls):
            return value
        name = value.name if isinstance(value, enum.Enum) else value
        if isinstance(name, str) and name.upper() in cls.__members__:
            return cls[name.upper()]
        allowed = ", ".join(cls.__members__)
        raise ValueError(f"state_dict_type: unsupported value {value!r}; allowed: {allowed}")


def _check_bools(record: object, *names: str) -> None:
    for name in names:
        value = getattr(record, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


@dataclass(frozen=True, slots=True)
class FullStateDictConfig:
    """Options of ``FULL_STATE_DICT``.

    ``offload_to_cpu``: return tensors in host memory. ``rank0_only``: only world rank 0
    gets the state dict (the others take part in the gathers and get ``{}``).
    """

    offload_to_cpu: bool = False
    rank0_only: bool = False

    def __post_init__(self) -> None:
        _check_bools(self, "offload_to_cpu", "rank0_only")


@dataclass(frozen=True, slots=True)
class ShardedStateDictConfig:
    """Options of ``SHARDED_STATE_DICT``: ``offload_to_cpu`` returns host-memory copies."""

    offload_to_cpu: bool = False

    def __post_init__(self) -> None:
        _check_bools(self, "offload_to_cpu")
